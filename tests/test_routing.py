"""The replica router (planning/routing.py): a prompt goes where its longest prefix was
sent unless that replica is loaded beyond the others; what it knows is text chunks named by
a hash chain, per replica, bounded; a gone replica leaves at once."""

import pytest

from xinference.model.llm.vllm.xavier.planning.routing import (
    CHUNK_CHARS,
    ReplicaRouter,
    chunk_chain,
    parse_routing,
    prompt_text,
)

SYSTEM = "You are a careful assistant. " * 200  # ~5.8K characters shared by every user


def ask(router, text, replicas=(0, 1), finish=True):
    decision = router.route(chunk_chain(text), len(text), list(replicas))
    if finish:
        router.finished(decision.replica, len(text) - decision.matched_chars)
    return decision


def test_a_prompt_goes_where_its_prefix_was_sent_and_new_prefixes_go_round():
    router = ReplicaRouter()
    first = [ask(router, f"document {d}: " + "x" * 3000) for d in range(4)]
    assert [d.reason for d in first] == ["load"] * 4
    assert sorted(d.replica for d in first) == [0, 0, 1, 1]  # ties go round the replicas
    for d, where in enumerate(first):
        follow = ask(router, f"document {d}: " + "x" * 3000 + f" question {d}?")
        assert (follow.replica, follow.reason) == (where.replica, "affinity")
        assert follow.matched_chars == (len(f"document {d}: ") + 3000) // CHUNK_CHARS * CHUNK_CHARS
    assert router.counts[0] == {"affinity": 2, "load": 2, "fallback": 0}


def test_the_warm_replica_is_left_once_it_holds_more_than_its_share_in_flight():
    """Ten requests of one prefix in flight: affinity while the warm replica has no more
    than 1.5 x the cold one's plus 2; the 4th goes to the cold one (Xavier loads the prefix
    there); from then on both hold it and the rest go to the less loaded of the two."""
    router = ReplicaRouter(imbalance_ratio=1.5, imbalance_requests=2)
    decisions = [ask(router, SYSTEM + f"user {u}", finish=False) for u in range(10)]
    warm = decisions[0].replica
    assert [d.replica for d in decisions[:3]] == [warm] * 3
    assert [d.reason for d in decisions[:3]] == ["load", "affinity", "affinity"]
    cold = decisions[3]
    assert (cold.reason, cold.matched_chars) == ("load", 0) and cold.replica != warm
    assert [d.reason for d in decisions[4:]] == ["affinity"] * 6
    assert router.in_flight() == {0: 5, 1: 5}
    for d in decisions:
        router.finished(d.replica, 0)
    assert router.in_flight() == {0: 0, 1: 0}


def test_a_short_shared_start_is_no_affinity():
    """Under ``min_match_ratio`` of the prompt known: routed by load."""
    router = ReplicaRouter(min_match_ratio=0.3)
    a = ask(router, "p" * 1024 + "a" * 8192)
    b = ask(router, "p" * 1024 + "b" * 8192)  # 1024 of 9216 known: 11 %
    assert (a.reason, b.reason) == ("load", "load") and a.replica != b.replica


def test_what_a_replica_was_sent_is_bounded_least_recently_used_first():
    router = ReplicaRouter(capacity=40)  # 40 chunks: one prompt of 32 and a little
    old = ask(router, "o" * (32 * CHUNK_CHARS), replicas=[0])
    ask(router, "n" * (32 * CHUNK_CHARS), replicas=[0])  # pushes most of the old one out
    again = router.route(chunk_chain("o" * (32 * CHUNK_CHARS)), 32 * CHUNK_CHARS, [0, 1])
    assert old.replica == 0 and again.reason == "load"


def test_a_gone_replica_leaves_the_candidates_at_once():
    router = ReplicaRouter()
    where = ask(router, SYSTEM, replicas=[0, 1, 2]).replica
    survivors = [r for r in (0, 1, 2) if r != where]
    router.forget(survivors)
    d = ask(router, SYSTEM + "more", replicas=survivors)
    assert d.replica in survivors and d.reason == "load"
    assert where not in router.in_flight()
    back = ask(router, SYSTEM + "again", replicas=[0, 1, 2])  # the gone one, back: it holds
    assert back.reason == "affinity" and back.replica == d.replica  # nothing of the old
    with pytest.raises(ValueError, match="^replicas:"):
        router.route(chunk_chain(SYSTEM), len(SYSTEM), [])


def test_prompt_text_of_chats_and_completions():
    chat = {"messages": [{"role": "system", "content": "sys"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"},
                                                      {"type": "image_url", "image_url": "u"}]}]}
    text = prompt_text(chat)
    assert text.startswith("system\x1fsys\x1euser\x1fhi")
    longer = {"messages": chat["messages"] + [{"role": "assistant", "content": "yo"}]}
    assert prompt_text(longer).startswith(text)  # a growing history keeps its prefix
    assert prompt_text({"prompt": "abc"}) == "abc"
    assert prompt_text({"prompt": ["abc", "def"]}) == "abc"
    assert prompt_text({"prompt": [1, 2, 3]}) is None and prompt_text({}) is None


def test_the_chain_names_whole_chunks_each_covering_all_before_it():
    a = chunk_chain("a" * 600 + "tail one")
    b = chunk_chain("a" * 600 + "tail two, longer")
    assert len(a) == 2 and a == b[:2]
    assert chunk_chain("b" + "a" * 599)[1] != a[1]  # a change early renames every later chunk
    assert chunk_chain("short") == []
    assert chunk_chain("é" * 512) != chunk_chain("e" * 512)


@pytest.mark.parametrize("value, policy", [("cache_aware", "cache_aware"),
                                           ("Round-Robin", "round_robin")])
def test_the_option_parses(value, policy):
    assert parse_routing(value) == policy


def test_a_bad_option_is_named():
    with pytest.raises(ValueError, match="^xavier_routing: expected one of cache_aware, "
                                         "round_robin, got 'sticky'"):
        parse_routing("sticky")


def test_a_prompts_first_chunks_are_the_last_forgotten():
    """Past the capacity a replica forgets least recently used chunks; within one prompt the
    first chunks (what later prompts share) count as the most recent, and a prompt longer
    than the capacity keeps its head."""
    router = ReplicaRouter(capacity=8)
    long = "h" * (4 * CHUNK_CHARS) + "t" * (12 * CHUNK_CHARS)  # 16 chunks, capacity 8
    ask(router, long, replicas=[0])
    head = router.route(chunk_chain(long[:4 * CHUNK_CHARS] + "?"), 4 * CHUNK_CHARS + 1, [0, 1])
    assert (head.replica, head.reason, head.matched_chars) == (0, "affinity", 4 * CHUNK_CHARS)
