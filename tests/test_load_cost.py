"""The cost model that decides whether a hit is worth loading (planning/load_cost.py): the
step-time fit it measures from vLLM's steps, the waits it keeps per load level, and its
decisions (crossover, load level, exploration)."""

import random

import pytest

from xinference.model.llm.vllm.xavier.planning.load_cost import LoadCost, busy_level_of, level_of

FIXED, PER_TOKEN = 0.004, 8e-6  # a step's fixed time, a prefill token's (the H200's 0.5B)


def waited(cost: LoadCost, seconds: float, others: int = 0, lookup_s: float = 0.0) -> None:
    """Two hits of the same wait at the key of ``others`` now (a key's wait is known from
    its second sample on)."""
    for _ in range(2):
        cost.hit_waited(seconds, cost.wait_key(others), lookup_s=lookup_s)


def served(cost: LoadCost, steps: int = 200, seed: int = 0, start: float = 0.0) -> float:
    """Steps as vLLM would build them: decode steps and prefill chunks, each interval the
    time of the forward ``cost.lag`` steps before; returns the clock at the end."""
    rnd = random.Random(seed)
    now, tokens = start, []
    for i in range(steps):
        t = rnd.choice([1, 8, 512, 2048, 8192])
        if i:
            now += FIXED + (PER_TOKEN * tokens[-1 - cost.lag] if len(tokens) > cost.lag else 0)
        cost.step(now, t)
        tokens.append(t)
    return now


@pytest.mark.parametrize("lag", [0, 1])
def test_the_fit_finds_the_engines_prefill_time_per_token_with_its_lag(lag):
    cost = LoadCost(lag=lag)
    served(cost)
    fixed, per_token = cost.step_line()
    assert per_token == pytest.approx(PER_TOKEN, rel=1e-6)
    assert fixed == pytest.approx(FIXED, rel=1e-4)


def test_a_wrong_lag_finds_no_slope():
    """Negative control: read against the wrong step's tokens the same intervals give no
    slope (the draws are independent), so the model would not decide on them."""
    cost = LoadCost(lag=0)
    rnd = random.Random(1)
    now, tokens = 0.0, []
    for _ in range(400):  # each interval is the forward of the step before (async)
        t = rnd.choice([1, 8, 512, 2048, 8192])
        if len(tokens) > 1:
            now += FIXED + PER_TOKEN * tokens[-2]
        cost.step(now, t)
        tokens.append(t)
    line = cost.step_line()
    assert line is None or line[1] < PER_TOKEN / 5


def test_an_idle_engine_between_two_steps_is_not_a_step():
    cost = LoadCost(lag=1)
    now = served(cost)
    cost.idle()  # every request finished; the next arrives a minute later
    now = served(cost, start=now + 60.0, seed=2)
    assert cost.step_line()[1] == pytest.approx(PER_TOKEN, rel=1e-6)
    # without the idle mark a long gap still is no step (longer than max_interval_s)
    cost.step(now + 120.0, 1)
    assert cost.step_line()[1] == pytest.approx(PER_TOKEN, rel=1e-6)


def test_nothing_is_known_until_steps_vary_and_a_hit_was_measured():
    cost = LoadCost(lag=0)
    assert cost.pays(16, 0) and cost.step_line() is None
    alike = FIXED + PER_TOKEN * 64
    for i in range(100):  # all alike: no slope
        cost.step(alike * i, 64)
    assert cost.step_line() is None and cost.pays(16, 0)
    served(cost, start=alike * 100)
    assert cost.step_line() is not None
    assert cost.pays(16, 0)  # no hit measured yet: load (and measure)
    assert cost.figures()["cost_hit_wait_us"] == 0
    waited(cost, 0.008, 0)
    assert not cost.pays(16, 0)
    assert cost.figures() == {"cost_prefill_ns_per_token": 8000, "cost_step_fixed_us": 4000,
                              "cost_hit_wait_us": 8000}


def test_alone_a_hit_loads_from_the_crossover_where_its_wait_equals_the_recompute():
    """A user never waits longer for a hit than for its recompute: 8 ms of wait at 8 µs a
    token pays from 1000 tokens on."""
    cost = LoadCost(lag=1)
    served(cost)
    waited(cost, 0.008, 0)
    assert not cost.pays(992, 0)
    assert cost.pays(1008, 0)
    assert cost.recompute_s(1008, 0) == pytest.approx(1008 * PER_TOKEN)


def test_under_load_a_recompute_delays_everyone_so_a_short_hit_still_pays():
    cost = LoadCost(lag=1)
    served(cost)
    for others in (0, 31):
        waited(cost, 0.040, others)
    assert not cost.pays(2048, others=0)  # 40 ms against 16 ms
    assert cost.pays(2048, others=31)  # against 32 x 16 ms
    assert not cost.pays(128, others=31)  # 40 ms against 32 x 1 ms


def test_a_wait_seen_under_load_does_not_decide_for_a_lone_request():
    cost = LoadCost(lag=1)
    served(cost)
    waited(cost, 0.500, 40)  # a long wait at C32+
    assert cost.expected_wait_s(0) is None and cost.pays(512, 0)  # C1 measures its own
    waited(cost, 0.002, 0)
    assert cost.pays(512, 0) and not cost.pays(512, 40)
    assert [level_of(n) for n in (0, 1, 2, 3, 4, 31, 32, 10_000)] == [0, 1, 2, 2, 3, 5, 6, 7]


def test_a_keys_wait_is_the_lowest_of_its_last_samples_known_from_the_second():
    """One sample may hold a one-time cost (H100, session 32: the first load from a peer,
    which maps its memory, waited ~320 ms and then declined every C1 hit on an idle engine):
    a key's wait is known from its second sample and is the lowest of its last 4, so one
    outlier never declines alone; four long waits in a row do."""
    cost = LoadCost(lag=1, wait_samples=4)
    served(cost)
    key = cost.wait_key(0)
    cost.hit_waited(0.320, key)
    assert cost.wait_s_at(key) is None and cost.pays(512, 0)  # one sample: loaded
    assert cost.figures()["cost_hit_wait_us"] == 320_000  # (shown all the same)
    cost.hit_waited(0.016, key)
    assert cost.wait_s_at(key) == pytest.approx(0.016)
    for _ in range(3):
        cost.hit_waited(0.100, key)
    assert cost.wait_s_at(key) == pytest.approx(0.016)  # still in the last 4
    cost.hit_waited(0.100, key)
    assert cost.wait_s_at(key) == pytest.approx(0.100)
    assert cost.wait_samples_at(key) == [0.100] * 4


def test_a_declined_level_loads_every_nth_hit_to_measure_its_wait_again():
    cost = LoadCost(lag=1, explore_every=4)
    served(cost)
    waited(cost, 0.050, 0)
    assert [cost.decide(64, 0) for _ in range(8)] == [False, False, False, True] * 2
    # a skipped lookup is a decline of the level too: every 4th request is looked up
    assert [cost.worth_looking_up(64, 0, lookup_pending=True) for _ in range(4)] == [
        False, False, False, True]
    assert cost.decide(64, 0)  # that request's hit is loaded: its wait measured again
    assert [cost.decide(64, 0) for _ in range(3)] == [False, False, False]
    assert cost.worth_looking_up(64, 0, lookup_pending=True)  # the 4th in the run
    assert cost.decide(100_000, 0)  # a hit that pays resets the count
    assert not cost.decide(64, 0)


def test_judge_counts_but_never_declines_when_asked_to_load_everything():
    cost = LoadCost(lag=1, explore_every=2)
    served(cost)
    waited(cost, 0.050, 0)
    assert [cost.judge(64, 0, decline=False) for _ in range(3)] == [(False, True)] * 3
    assert [cost.judge(64, 0, decline=True) for _ in range(2)] == [(False, False),
                                                                   (False, True)]
    assert cost.judge(100_000, 0, decline=True) == (True, True)
    # a hit that paid in between: the next one that does not is the first of a new run
    assert cost.judge(64, 0, decline=True) == (False, False)
    assert cost.judge(100_000, 0, decline=True) == (True, True)
    assert cost.judge(64, 0, decline=True) == (False, False)


def test_a_recompute_beyond_the_token_budget_pays_a_steps_fixed_time_per_budget():
    cost = LoadCost(lag=1, token_budget=2048)
    served(cost)
    assert cost.recompute_s(4096, 0) == pytest.approx(4096 * PER_TOKEN + 2 * FIXED)
    assert cost.recompute_s(2047, 1) == pytest.approx(2 * 2047 * PER_TOKEN)


@pytest.mark.parametrize("kwargs, name", [({"lag": -1}, "lag"),
                                          ({"wait_samples": 1}, "wait_samples"),
                                          ({"explore_every": 0}, "explore_every"),
                                          ({"remeasure_after_s": 0}, "remeasure_after_s")])
def test_bad_settings_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        LoadCost(**kwargs)


def test_a_noisy_fit_declines_less_never_more():
    """Steps of 1 and 64 tokens on a loaded host (±5 ms around each interval): the slope is
    uncertain, so the model decides with its upper bound and loads a hit that an exact fit
    of the same engine declines."""
    rnd = random.Random(3)
    exact, noisy = LoadCost(lag=0), LoadCost(lag=0)
    now_e = now_n = 0.0
    for i in range(300):
        t = (1, 64)[i % 2]
        exact.step(now_e, t)
        noisy.step(now_n, t)
        now_e += FIXED + PER_TOKEN * t
        now_n += FIXED + PER_TOKEN * t + rnd.uniform(-0.005, 0.005)
    for cost in (exact, noisy):
        waited(cost, 0.004, 0)  # pays from 500 tokens on
    assert exact.prefill_s_per_token_high() == pytest.approx(PER_TOKEN, rel=1e-3)
    assert noisy.prefill_s_per_token_high() > 1.5 * PER_TOKEN
    assert not exact.pays(320, 0) and noisy.pays(320, 0)


def test_the_connectors_own_time_and_steps_that_computed_nothing_are_not_prefill():
    """Without async scheduling an interval also holds the connector's time in the next
    schedule (a lookup's bounded wait, up to 10 ms): given as ``host_s``, it is taken out;
    an interval after a step of 0 tokens (nothing computed: a request waits for its load)
    is no sample."""
    cost = LoadCost(lag=0)
    rnd = random.Random(4)
    now = 0.0
    for _ in range(200):
        t = rnd.choice([0, 1, 8, 512, 2048])
        waited = rnd.choice([0.0, 0.010])  # this schedule waited for a lookup, or not
        now += waited
        cost.step(now, t, host_s=waited)
        now += 0.030 if t == 0 else FIXED + PER_TOKEN * t  # an idle poll takes anything
    fixed, per_token = cost.step_line()
    assert (fixed, per_token) == (pytest.approx(FIXED), pytest.approx(PER_TOKEN))


def test_a_lookup_not_yet_answered_counts_against_a_short_request():
    """Before its answer a request would still pay the lookup's wait: one whose candidate
    blocks could save less than lookup + load wait is not looked up; once answered (the
    lookup paid), the same blocks are judged by the load's wait alone."""
    cost = LoadCost(lag=1)
    served(cost)
    waited(cost, 0.004, 0, lookup_s=0.004)  # a lone hit: pays from 500 tokens on
    assert cost.pays(640, 0)
    assert not cost.worth_looking_up(640, 0, lookup_pending=True)  # 5.1 ms < 4 + 4 ms
    assert cost.worth_looking_up(640, 0, lookup_pending=False)
    assert cost.worth_looking_up(1008, 0, lookup_pending=True)


def test_a_short_recompute_is_read_off_the_step_time_curve_not_the_line():
    """Prefill is convex in tokens (CPU machine, C1: a 64-token recompute added ~1-2 ms
    while a line through all steps said 5.6 ms): steps of 1, 72, 264 and 1032 tokens
    taking 4, 5, 8 and 40 ms.  A 64-token hit that waits 2 ms does not pay (it adds about
    1 ms to a step) -- the line alone says it does; a 1024-token one pays."""
    step_ms = {1: 4.0, 72: 5.0, 264: 8.0, 1032: 40.0}
    curve, line_only = LoadCost(lag=0), LoadCost(lag=0)
    line_only.curve.min_samples = 10 ** 9  # (no bin ever counts: the line decides)
    rnd = random.Random(5)
    now = 0.0
    for _ in range(400):
        t = rnd.choice(list(step_ms))
        for cost in (curve, line_only):
            cost.step(now, t)
        now += step_ms[t] / 1000
    for cost in (curve, line_only):
        waited(cost, 0.002, 0)
    assert curve.recompute_s(64, 0) == pytest.approx(0.001 * 64 / 71, rel=0.05)
    assert line_only.recompute_s(64, 0) > 0.002
    assert not curve.pays(64, 0) and line_only.pays(64, 0)
    assert curve.pays(1024, 0) and curve.pays(256, 0)
    # beyond the largest step seen the line's upper slope decides (the dearer side)
    assert curve.recompute_s(4096, 0) == line_only.recompute_s(4096, 0)


def test_a_wait_seen_behind_a_bursts_long_steps_does_not_decide_for_an_idle_engine():
    """Session 31's trap (CPU machine): the last requests of a C32 fill, alone on the engine
    but behind its long steps, taught a 70 ms wait at load level 0, and every later C1 hit
    on an idle engine was declined (a 512-token recompute: ~60 ms).  The wait is kept by the
    step in flight too: behind a 4096-token step the 70 ms still declines; on the idle
    engine the first hit is loaded (and measured)."""
    cost = LoadCost(lag=1)
    now = served(cost)
    cost.step(now + 0.01, 4096)  # the burst's tail: one long step in flight
    behind_burst = cost.wait_key(0)
    cost.hit_waited(0.070, behind_burst)
    cost.hit_waited(0.070, behind_burst)
    assert behind_burst == (0, 7) and not cost.pays(2048, 0)  # 70 ms against 16 ms
    cost.idle()  # the burst ended; a lone request arrives
    assert cost.wait_key(0) == (0, 0)
    assert cost.expected_wait_s(0) is None and cost.decide(2048, 0)
    waited(cost, 0.004, 0)
    assert cost.decide(2048, 0) and not cost.decide(256, 0)  # its own crossover: 500 tokens
    assert [busy_level_of(n) for n in (0, 1, 31, 32, 64, 100, 2047, 2048, 10 ** 6)] == [
        0, 0, 0, 1, 2, 2, 6, 7, 7]


def test_a_wait_older_than_remeasure_after_s_is_measured_again_by_one_hit():
    """A declined key's wait is not trusted for ever: once it is older than
    ``remeasure_after_s`` (on the steps' clock; the gaps here are no step samples) the next
    declined hit is loaded, one only; then the key declines again until its wait is
    measured afresh or ages again."""
    cost = LoadCost(lag=1, explore_every=1000, remeasure_after_s=10.0, max_interval_s=1.0)
    now = served(cost)
    key = cost.wait_key(0)
    cost.hit_waited(0.050, key)
    cost.hit_waited(0.050, key)
    assert [cost.decide(64, 0) for _ in range(3)] == [False] * 3
    cost.step(now + 9.0, 1)
    cost.step(now + 9.5, cost._tokens[-2])  # the same step in flight as when measured
    assert cost.wait_key(0) == key and not cost.decide(64, 0)
    cost.step(now + 10.5, 1)
    cost.step(now + 11.0, cost._tokens[-2])
    assert [cost.decide(64, 0) for _ in range(3)] == [True, False, False]
    # a skipped lookup explores the same way; the request's hit is then loaded
    cost.step(now + 22.0, 1)
    cost.step(now + 22.5, cost._tokens[-2])
    assert cost.worth_looking_up(64, 0, lookup_pending=False)
    assert cost.decide(64, 0) and not cost.decide(64, 0)


def test_a_lookup_made_to_explore_loads_its_hit_even_once_the_key_moved():
    """The lookup's answer comes steps later; by then the step in flight (so the key) has
    changed: the hit is loaded all the same, once (the next one is judged again)."""
    cost = LoadCost(lag=1, explore_every=2)
    now = served(cost)
    cost.step(now + 0.01, 1)
    waited(cost, 0.050, 0)  # at the key of a 1-token step in flight: (0, 0)
    cost.step(now + 0.02, 4096)
    waited(cost, 0.050, 0)  # and behind a long one: (0, 7)
    cost.step(now + 0.03, 1)
    assert [cost.worth_looking_up(64, 0, lookup_pending=True) for _ in range(2)] == [
        False, True]  # explored at (0, 0)
    cost.step(now + 0.04, 4096)  # the answer comes while a long step is in flight
    assert cost.wait_key(0) == (0, 7)
    assert cost.decide(64, 0)  # loaded: measured again
    assert not cost.decide(64, 0)


def test_lookups_that_find_no_hit_leave_a_stale_keys_exploration_to_the_next_hit():
    """The C1 row of the H100 run (session 34): every first ask of a prompt is looked up
    and finds nothing, then its follow-up on the other replica is a hit.  A stale key's
    lookups are made without using its one exploration up, so the first follow-up hit
    judged there is loaded and measures the wait again (before: the first lookup took the
    exploration, and 16 of 16 follow-ups were declined on a wait learned 17 s earlier)."""
    cost = LoadCost(lag=1, explore_every=1000, remeasure_after_s=10.0, max_interval_s=1.0)
    now = served(cost)
    cost.step(now + 0.01, 1)
    waited(cost, 0.125, 0)  # a wait learned in another phase (the fill's tail)
    key = cost.wait_key(0)
    cost.step(now + 17.0, 1)
    cost.step(now + 17.5, cost._tokens[-2])
    assert cost.wait_key(0) == key
    assert all(cost.worth_looking_up(8192, 0, lookup_pending=True) for _ in range(16))
    assert [cost.decide(8192, 0) for _ in range(3)] == [True, False, False]


def test_an_exploration_credit_waits_for_a_hit_through_later_declined_lookups():
    """A lookup explored at the ``explore_every``-th decline finds no hit; the lookups
    declined after it do not take the credit back: the next hit judged is loaded."""
    cost = LoadCost(lag=1, explore_every=3)
    now = served(cost)
    cost.step(now + 0.01, 1)
    waited(cost, 0.125, 0)
    assert [cost.worth_looking_up(8192, 0, lookup_pending=True) for _ in range(4)] == [
        False, False, True, False]
    assert cost.decide(8192, 0) and not cost.decide(8192, 0)


def test_a_waiting_hits_key_widens_to_the_busiest_load_it_waited_through():
    """:meth:`LoadCost.widened`: the load level and the busy level only grow (a quiet step
    after a busy one does not narrow the key back), each by the step just built."""
    cost = LoadCost(lag=1)
    key = (0, 0)
    key = cost.widened(key, 3, 0)  # three other hits waiting beside it, nothing scheduled
    assert key == (level_of(3), 0) == (2, 0)
    key = cost.widened(key, 0, 8192)  # a long prefill chunk in the step
    assert key == (2, busy_level_of(8192)) == (2, 7)
    assert cost.widened(key, 1, 1) == (2, 7)  # a quiet step later: still the busiest
