"""Which replica serves a request: the one that holds its prompt's longest prefix, unless
that one is loaded beyond the others (#37).  Pure: no Xinference, no vLLM.

Xinference 3.5.0 picks a replica before it has read the prompt (``SupervisorActor.
get_model``: ``next(replica_info.scheduler)``, a cycle).  For a model launched with Xavier
the REST layer asks :class:`ReplicaRouter` instead (``replica_routing.py`` wires it in).

**Prefix knowledge: what the router sent where, as text.**  A prompt (a completion's text,
or a chat's messages in order, each as role and content) is cut into chunks of
:data:`CHUNK_CHARS` characters and named by a hash chain (chunk ``i``'s name covers chunks
``0..i``); each replica keeps the names of the prompts sent to it, least recently used
forgotten past ``capacity`` names (16,384 by default: 4 M characters of prompts, about
3 MB of the API process's memory per replica; which replicas were sent a name is one int,
a bit per replica).  A replica that was sent a prompt holds its prefix
(computed, or loaded from its peer) until its vLLM cache evicts it; the router does not
see evictions, and need not: with Xavier a prefix the chosen replica has lost is loaded
from a peer that still holds it, or recomputed -- a slower hit, never a wrong one.  Why not
Xavier's block directory, which knows exactly: its block names are hashes of token ids,
so the API would have to tokenize every prompt with the model's chat template (milliseconds
for an 8K prompt) and ask the directory (a round trip) before choosing; the chain costs tens
of microseconds for the same prompt and no call.

**Load: what the router has in flight**, per replica: requests routed and not finished,
and the characters of theirs no replica was known to hold (what each still has to
prefill).  Both are the router's own counts (no call on the request's path).

**The rule** (SGLang's cache-aware router and llm-d's "sticky until saturated", made
cheaper to leave because a cold replica loads the prefix from its peer):

1. The replicas holding the longest known prefix, if it covers at least
   ``min_match_ratio`` of the prompt: the least loaded of them, unless it has more than
   ``imbalance_ratio`` x the least loaded replica's requests in flight plus
   ``imbalance_requests`` -- then the least loaded replica (``load``).
2. Otherwise the least loaded replica (``load``); ties go round the replicas in turn.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, OrderedDict, Sequence, Tuple

#: ``xavier_routing``: ``cache_aware`` (the default with Xavier) or ``round_robin``
#: (Xinference's own cycle)
ROUTING_POLICIES = ("cache_aware", "round_robin")
#: the characters of one named chunk of a prompt
CHUNK_CHARS = 256
#: why a request went where it went (the counters' names)
REASONS = ("affinity", "load", "fallback")


def parse_routing(value: Any) -> str:
    """``xavier_routing`` as one of :data:`ROUTING_POLICIES` (any case, ``-`` for ``_``);
    anything else raises ``ValueError`` naming the option."""
    text = str(value).strip().lower().replace("-", "_")
    if text not in ROUTING_POLICIES:
        raise ValueError(f"xavier_routing: expected one of {', '.join(ROUTING_POLICIES)}, "
                         f"got {value!r}")
    return text


def prompt_text(body: Mapping[str, Any]) -> Optional[str]:
    """The text a request's prompt starts with, as the router names it: a chat's messages
    in order (role, then content; a content given as parts: its text parts, others as
    JSON), or a completion's prompt (a list of prompts: the first); None when neither."""
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        out: List[str] = []
        for m in messages:
            if not isinstance(m, Mapping):
                out.append(json.dumps(m, sort_keys=True, default=str))
                continue
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(
                    p.get("text", "") if isinstance(p, Mapping) and p.get("type") == "text"
                    else json.dumps(p, sort_keys=True, default=str) for p in content)
            out.append(f"{m.get('role', '')}\x1f{'' if content is None else content}\x1e")
        return "".join(out)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt and isinstance(prompt[0], str) else None
    return prompt if isinstance(prompt, str) else None


def chunk_chain(text: str, chunk_chars: int = CHUNK_CHARS) -> List[int]:
    """Names (64-bit) of the prompt's whole chunks, each covering every chunk before it."""
    names: List[int] = []
    prev = b""
    # chunks by characters, hashed as UTF-8 (a character never splits)
    for start in range(0, len(text) - chunk_chars + 1, chunk_chars):
        chunk = text[start:start + chunk_chars].encode("utf-8", "surrogatepass")
        prev = hashlib.blake2b(prev + chunk, digest_size=8).digest()
        names.append(int.from_bytes(prev, "little"))
    return names


@dataclass(frozen=True)
class RouteDecision:
    """Where one request goes and why (:data:`REASONS`)."""

    replica: int
    reason: str
    #: characters of the prompt the chosen replica was known to hold
    matched_chars: int = 0


@dataclass
class _Replica:
    names: OrderedDict[int, None] = field(default_factory=collections.OrderedDict)
    in_flight: int = 0
    uncached_chars: int = 0


class ReplicaRouter:
    """The routing state of one model (see the module docstring).  Not thread-safe: the
    API's event loop only."""

    def __init__(self, capacity: int = 1 << 14, min_match_ratio: float = 0.3,
                 imbalance_ratio: float = 1.5, imbalance_requests: int = 2,
                 chunk_chars: int = CHUNK_CHARS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        if not 0 <= min_match_ratio <= 1:
            raise ValueError(f"min_match_ratio: must be in [0, 1], got {min_match_ratio}")
        if imbalance_ratio < 1 or imbalance_requests < 0:
            raise ValueError(f"imbalance_ratio, imbalance_requests: must be >= 1 and >= 0, "
                             f"got {imbalance_ratio}, {imbalance_requests}")
        self.capacity, self.min_match_ratio = capacity, min_match_ratio
        self.imbalance_ratio, self.imbalance_requests = imbalance_ratio, imbalance_requests
        self.chunk_chars = chunk_chars
        self._replicas: Dict[int, _Replica] = {}
        self._holders: Dict[int, int] = {}  # chunk name -> replicas sent it (bit r: r)
        self._turn = itertools.count()
        self.counts: Dict[int, Dict[str, int]] = collections.defaultdict(
            lambda: dict.fromkeys(REASONS, 0))

    # ------------------------------------------------------------------ routing
    def route(self, chain: Sequence[int], prompt_chars: int,
              replicas: Sequence[int]) -> RouteDecision:
        """Choose one of ``replicas`` (the live ones, none empty) for a prompt of
        ``prompt_chars`` characters named by ``chain`` (:func:`chunk_chain`), and count it
        in flight there (:meth:`finished` when it ends)."""
        if not replicas:
            raise ValueError("replicas: no live replica to route to")
        live = list(dict.fromkeys(int(r) for r in replicas))
        if min(live) < 0:
            raise ValueError(f"replicas: replica ids are >= 0, got {live}")
        for r in live:
            self._replicas.setdefault(r, _Replica())
        held, matched = self._longest_holders(chain, live)
        turn = next(self._turn)
        order = {r: (i - turn) % len(live) for i, r in enumerate(live)}

        def load(r: int) -> Tuple[int, int, int]:
            s = self._replicas[r]
            return s.in_flight, s.uncached_chars, order[r]

        least = min(live, key=load)
        matched_chars = matched * self.chunk_chars
        choice, reason = least, "load"
        if held and matched_chars >= self.min_match_ratio * max(1, prompt_chars):
            warm = min(held, key=load)
            bound = (self.imbalance_ratio * self._replicas[least].in_flight
                     + self.imbalance_requests)
            if self._replicas[warm].in_flight <= bound:
                choice, reason = warm, "affinity"
        if choice not in held:
            matched_chars = self._matched(choice, chain) * self.chunk_chars
        self._sent(choice, chain, max(0, prompt_chars - matched_chars))
        self.counts[choice][reason] += 1
        return RouteDecision(choice, reason, matched_chars)

    def fallback(self, replica: Optional[int] = None) -> None:
        """Count a request that went round-robin because routing failed (``replica`` when
        known, else -1)."""
        self.counts[-1 if replica is None else int(replica)]["fallback"] += 1

    def finished(self, replica: int, uncached_chars: int) -> None:
        """A request routed to ``replica`` ended (answered, failed or cancelled)."""
        s = self._replicas.get(int(replica))
        if s is not None:
            s.in_flight = max(0, s.in_flight - 1)
            s.uncached_chars = max(0, s.uncached_chars - uncached_chars)

    def forget(self, keep: Iterable[int]) -> None:
        """Drop every replica not in ``keep`` (gone: its names and loads leave at once)."""
        keep_set = {int(r) for r in keep}
        for r in [r for r in self._replicas if r not in keep_set]:
            for name in self._replicas.pop(r).names:
                self._drop_holder(name, r)

    def in_flight(self) -> Dict[int, int]:
        """Requests in flight per replica."""
        return {r: s.in_flight for r, s in self._replicas.items()}

    # ------------------------------------------------------------------ internals
    def _longest_holders(self, chain: Sequence[int], live: List[int]) -> Tuple[List[int], int]:
        """The live replicas sent the longest prefix of ``chain`` and its length (chunks)."""
        alive = 0
        for r in live:
            alive |= 1 << r
        held, matched = 0, 0
        for i, name in enumerate(chain):
            alive &= self._holders.get(name, 0)
            if not alive:
                break
            held, matched = alive, i + 1
        return [r for r in live if held >> r & 1], matched

    def _matched(self, replica: int, chain: Sequence[int]) -> int:
        """How many chunks of ``chain`` from its start ``replica`` was sent."""
        names = self._replicas[replica].names
        n = 0
        for name in chain:
            if name not in names:
                break
            n += 1
        return n

    def _sent(self, replica: int, chain: Sequence[int], uncached_chars: int) -> None:
        s = self._replicas[replica]
        s.in_flight += 1
        s.uncached_chars += uncached_chars
        # from the end: a prompt's first chunks (the prefix others share) are the most
        # recently used, the last forgotten; a chain longer than the capacity keeps its head
        for name in reversed(chain[:self.capacity]):
            if name in s.names:
                s.names.move_to_end(name)
            else:
                s.names[name] = None
                self._holders[name] = self._holders.get(name, 0) | 1 << replica
        while len(s.names) > self.capacity:
            old, _ = s.names.popitem(last=False)
            self._drop_holder(old, replica)

    def _drop_holder(self, name: int, replica: int) -> None:
        holders = self._holders.get(name, 0) & ~(1 << replica)
        if holders:
            self._holders[name] = holders
        else:
            self._holders.pop(name, None)
