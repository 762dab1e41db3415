"""Whether a hit is worth loading: its measured wait against the prefill it saves (#34).

Pure: no vLLM, no torch.  Fed by :class:`~.scheduler_side.SchedulerSide` from what vLLM's
scheduler does anyway (one call per step, one per hit that reached its first forward).

A hit makes its request wait from the step that allocates its blocks to its first forward
(vLLM's asynchronous load path: the load's step, its report, the step already scheduled); a
recompute instead adds the hit's tokens to the steps that prefill the request -- and every
request those steps carry waits for them too.  So a hit of ``n`` tokens is loaded when

    expected wait  <=  (1 + others) x n x (prefill time per token)
                       [+ one step's fixed time per token budget the n tokens fill]

``others``: the live requests the last step scheduled and the hits waiting for their loads,
besides this one (the scheduler side counts them).  With nothing else
running this is "a user never waits longer for a hit than for its recompute"; under load a
recompute delays everyone, so a load is worth more.  Both sides are measured on this engine
while it serves:

* **prefill time per token**: the slope of the interval between two steps on the tokens
  scheduled (exponentially weighted least squares, half-life ``half_life_steps``).  Under
  async scheduling vLLM schedules step k+1 once forward k-1 returned, so the interval after
  step k is forward k-1's (``lag`` 1); without it, forward k's (``lag`` 0), less the
  connector's own time in the next schedule (a lookup's bounded wait).  An interval whose
  forward computed nothing, during which the engine had no request (:meth:`LoadCost.idle`)
  or longer than ``max_interval_s`` is not a step's and is skipped.  The model decides with
  the slope plus two standard errors: a noisy fit (a loaded host) declines less, never more.
* **the wait**: per hit, blocks allocated -> first forward, kept per :data:`WaitKey` (the
  busiest seen from its allocation to its first forward, :meth:`LoadCost.widened`) as
  the lowest of its last ``wait_samples`` (4) samples, known from the second on (a single
  sample may hold a one-time cost -- the first load from a peer maps its memory: 320 ms on
  an H100, session 32 -- and the low side errs towards loading, as the recompute side
  does): the load level (``others`` in powers of two: 0, 1,
  2-3, 4-7, ...) and the tokens of the step in flight when the blocks were allocated (in
  powers of two from 32: the steps a hit waits behind), each widened to the busiest step
  built while it waited, so that neither a wait seen at 32 concurrent requests, nor one
  seen alone behind the tail of a C32 burst's long steps, nor one of a burst's hits
  allocated in one schedule decides for a lone request on an idle engine (CPU machine,
  session 31: the second taught a 70 ms wait that declined every later C1 hit; H100,
  session 37: the third declined 13 of 32).  A decision reads the key of the moment (the
  step in flight, the requests running and waiting), so a wait that grew busier than its
  start is kept where a later hit of that load looks, and the low side, again, loads.

Until both are known (fewer than two hits measured at its key; too few steps, or steps too alike to
give a slope; a slope not above zero) a hit is loaded: the model never declines on a guess.
A key whose hits keep being declined is measured again: every ``explore_every``-th hit
declined there in a row is loaded anyway, and so is the first declined once its wait is
older than ``remeasure_after_s`` (a wait learned in another phase of the load does not
decide for ever).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Tuple

#: the load levels (``others`` in powers of two) and the busy levels (tokens of the step in
#: flight in powers of two from :data:`BUSY_UNIT`); beyond the last, the last
LEVELS = 8
BUSY_UNIT = 32

#: what a hit's wait is kept by: ``(load level, busy level)``
WaitKey = Tuple[int, int]


def level_of(others: int) -> int:
    """The load level of ``others`` requests running beside a hit: 0, 1, 2-3, 4-7, ..."""
    return min(LEVELS - 1, max(0, int(others)).bit_length())


def busy_level_of(tokens: int) -> int:
    """The busy level of a step in flight scheduling ``tokens`` tokens: 0 (under 32: decodes
    of up to 31 requests, or nothing), 1 (32-63), 2 (64-127), ... 7 (2048 and more)."""
    return min(LEVELS - 1, (max(0, int(tokens)) // BUSY_UNIT).bit_length())


@dataclass
class StepTimeFit:
    """Exponentially weighted least squares of step interval (s) on scheduled tokens."""

    decay: float
    w: float = 0.0
    ww: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0
    yy: float = 0.0
    samples: int = 0

    def add(self, tokens: float, seconds: float) -> None:
        d = self.decay
        self.w = d * self.w + 1.0
        self.ww = d * d * self.ww + 1.0
        self.x = d * self.x + tokens
        self.y = d * self.y + seconds
        self.xx = d * self.xx + tokens * tokens
        self.xy = d * self.xy + tokens * seconds
        self.yy = d * self.yy + seconds * seconds
        self.samples += 1

    def line(self, min_samples: int,
             min_token_spread: float) -> Optional[Tuple[float, float, float]]:
        """``(fixed seconds, seconds per token, the latter's standard error)``, or None
        while the fit says nothing: too few samples, tokens spread less than
        ``min_token_spread`` (standard deviation), or a slope not above zero."""
        if self.samples < max(3, min_samples) or self.w <= 0:
            return None
        spread = self.w * self.xx - self.x * self.x
        if spread <= (min_token_spread * self.w) ** 2:
            return None
        slope = (self.w * self.xy - self.x * self.y) / spread
        if slope <= 0:
            return None
        fixed = (self.y - slope * self.x) / self.w
        # residual variance per sample, over the effective number of samples
        n_eff = self.w * self.w / self.ww
        rss = max(0.0, self.yy - fixed * self.y - slope * self.xy)
        variance = rss / self.w * n_eff / max(1e-9, n_eff - 2)
        slope_se = math.sqrt(variance / (n_eff * spread / (self.w * self.w)))
        return max(0.0, fixed), slope, slope_se


@dataclass
class StepTimeCurve:
    """Step interval (s) against scheduled tokens as a curve: an exponentially weighted
    mean (tokens, seconds) per power-of-two bin of tokens, joined by straight segments and
    extended by the nearest segment at both ends.  Prefill is convex in tokens (attention
    grows with the prompt): a line through all steps overestimates a short recompute
    (measured on the CPU machine: 5.6 ms for 64 tokens that really cost 1-2 ms).  Bins
    with fewer than ``min_samples`` samples are left out."""

    decay: float
    min_samples: float = 4.0
    bins: Dict[int, List[float]] = field(default_factory=dict)  # bin -> [w, tokens, s]

    def add(self, tokens: float, seconds: float) -> None:
        """One step's sample; every bin ages with it (a bin no step fell into for long
        fades: it was measured on another load)."""
        for b in self.bins.values():
            b[0], b[1], b[2], b[3] = (self.decay * b[0], self.decay * b[1],
                                      self.decay * b[2], self.decay * b[3])
        b = self.bins.setdefault(int(tokens).bit_length(), [0.0, 0.0, 0.0, 0.0])
        b[0], b[1], b[2], b[3] = b[0] + 1.0, b[1] + tokens, b[2] + seconds, b[3] + 1.0

    def points(self) -> List[Tuple[float, float]]:
        """``(mean tokens, mean seconds)`` of every bin with enough (weighted) samples, by
        tokens, never falling (a bin's noise cannot make more tokens look cheaper)."""
        pts = [(b[1] / b[0], b[2] / b[0]) for _, b in sorted(self.bins.items())
               if b[3] >= self.min_samples]
        for i in range(1, len(pts)):
            pts[i] = (pts[i][0], max(pts[i][1], pts[i - 1][1]))
        return pts

    def added_s(self, tokens: int) -> Optional[float]:
        """What ``tokens`` more tokens add to a step: the curve at ``tokens`` less the
        curve at 0 tokens; None while fewer than two bins are known or beyond the largest
        (the curve is not extended upward: the line's upper slope decides there)."""
        pts = self.points()
        if len(pts) < 2 or tokens > pts[-1][0]:
            return None

        def at(x: float) -> float:
            i = min(max(1, sum(1 for px, _ in pts if px < x)), len(pts) - 1)
            (x0, y0), (x1, y1) = pts[i - 1], pts[i]
            return y0 + (x - x0) * (y1 - y0) / max(1e-9, x1 - x0)

        return max(0.0, at(float(tokens)) - at(0.0))


class LoadCost:
    """See the module docstring.  Not thread-safe: the scheduler's thread only."""

    def __init__(self, lag: int = 1, token_budget: Optional[int] = None,
                 half_life_steps: float = 64.0, wait_samples: int = 4,
                 explore_every: int = 32, min_steps: int = 16,
                 min_token_spread: float = 16.0, max_interval_s: float = 60.0,
                 remeasure_after_s: float = 10.0) -> None:
        if lag < 0:
            raise ValueError(f"lag: must be >= 0, got {lag}")
        if wait_samples < 2:
            raise ValueError(f"wait_samples: must be >= 2, got {wait_samples}")
        if explore_every < 1:
            raise ValueError(f"explore_every: must be >= 1, got {explore_every}")
        if not remeasure_after_s > 0:
            raise ValueError(f"remeasure_after_s: must be > 0, got {remeasure_after_s}")
        self.lag = lag
        self.token_budget = token_budget if token_budget and token_budget > 0 else None
        self.fit = StepTimeFit(0.5 ** (1.0 / half_life_steps))
        self.curve = StepTimeCurve(0.5 ** (1.0 / half_life_steps))
        self.wait_samples = wait_samples
        self.explore_every = explore_every
        self.min_steps = min_steps
        self.min_token_spread = min_token_spread
        self.max_interval_s = max_interval_s
        self.remeasure_after_s = remeasure_after_s
        self._last_step_at: Optional[float] = None
        self._tokens: Deque[int] = collections.deque(maxlen=lag + 1)
        self._idle = False
        self._wait_s: Dict[WaitKey, Deque[float]] = {}
        self._lookup_s: Dict[WaitKey, Deque[float]] = {}
        #: when a key's wait was last measured (or a hit loaded to measure it again)
        self._measured_at: Dict[WaitKey, float] = {}
        self._last_key: Optional[WaitKey] = None  # that of the latest hit measured
        self._declined_in_a_row: Dict[WaitKey, int] = collections.defaultdict(int)
        self._explore_credit = False  # a lookup made to explore: load the next declined hit

    # ------------------------------------------------------------- measuring
    def step(self, now: float, tokens: int, host_s: float = 0.0) -> None:
        """vLLM built a step at ``now`` (s) scheduling ``tokens`` tokens; ``host_s``: the
        time the connector itself took in that step's scheduling (e.g. waiting for a
        lookup), which without async scheduling lengthens the interval by as much.  An
        interval whose forward computed nothing (0 tokens) is no sample."""
        last, self._last_step_at = self._last_step_at, now
        idle, self._idle = self._idle, False
        if (last is not None and not idle and len(self._tokens) == self.lag + 1
                and self._tokens[0] > 0 and 0 <= now - last <= self.max_interval_s):
            own = host_s if self.lag == 0 else 0.0
            self.fit.add(float(self._tokens[0]), max(0.0, now - last - own))
            self.curve.add(float(self._tokens[0]), max(0.0, now - last - own))
        if idle:
            self._tokens.clear()
        self._tokens.append(int(tokens))

    def idle(self) -> None:
        """The engine holds no request: the interval to its next step is not a step's."""
        self._idle = True
        self._tokens.clear()  # nothing in flight for a hit to wait behind

    def wait_key(self, others: int) -> WaitKey:
        """The key of a hit allocated now with ``others`` requests running beside it: their
        load level and the busy level of the latest step built (the one in flight)."""
        return level_of(others), busy_level_of(self._tokens[-1] if self._tokens else 0)

    def widened(self, key: WaitKey, others: int, tokens: int) -> WaitKey:
        """``key`` of a hit still waiting for its first forward once vLLM built a step that
        schedules ``tokens`` tokens for ``others`` requests besides it: the busiest load the
        hit waited through.  A wait is kept under that load, not only the one at its
        allocation: the hits of a burst on an idle engine are allocated beside nothing
        running (key ``(0, 0)``) but wait beside each other, behind one long schedule
        that allocates them all (H100, session 37: 16 hits of 512 blocks, 2.3 ms of
        scheduling each; their 88-151 ms kept at ``(0, 0)`` declined the lone C1 hits that
        followed, which waited 11-28 ms when loaded)."""
        return max(key[0], level_of(others)), max(key[1], busy_level_of(tokens))

    def hit_waited(self, seconds: float, at: WaitKey,
                   lookup_s: Optional[float] = 0.0) -> None:
        """A hit reached its first forward ``seconds`` after its blocks were allocated (its
        key ``at``: :meth:`wait_key` then, :meth:`widened` since); its lookup took
        ``lookup_s`` (asked to answered; None: it made none, e.g. found in a host index)."""
        self._last_key = at
        if self._last_step_at is not None:
            self._measured_at[at] = self._last_step_at
        for samples, value in ((self._wait_s, seconds), (self._lookup_s, lookup_s)):
            if value is not None:
                samples.setdefault(at, collections.deque(maxlen=self.wait_samples)).append(value)

    def _low(self, samples: Dict[WaitKey, Deque[float]], key: WaitKey) -> Optional[float]:
        """The lowest of ``key``'s last samples, or None before its second."""
        window = samples.get(key)
        return min(window) if window is not None and len(window) >= 2 else None

    # ------------------------------------------------------------- estimates
    def step_line(self) -> Optional[Tuple[float, float]]:
        """``(fixed seconds per step, prefill seconds per token)`` or None (not known)."""
        line = self.fit.line(self.min_steps, self.min_token_spread)
        return None if line is None else (line[0], line[1])

    def prefill_s_per_token_high(self) -> Optional[float]:
        """The prefill time per token the model decides with: the fit's slope plus two
        standard errors, so that a noisy fit makes a recompute look dearer and a hit is
        declined only when it clearly does not pay."""
        line = self._decision_line()
        return None if line is None else line[1]

    def _decision_line(self) -> Optional[Tuple[float, float]]:
        """``(fixed seconds per step, the slope plus two standard errors)`` or None."""
        line = self.fit.line(self.min_steps, self.min_token_spread)
        return None if line is None else (line[0], line[1] + 2.0 * line[2])

    def expected_wait_s(self, others: int) -> Optional[float]:
        """A hit's expected wait now with ``others`` running, or None (none measured at
        its key)."""
        return self.wait_s_at(self.wait_key(others))

    def wait_samples_at(self, key: WaitKey) -> List[float]:
        """The last samples of a hit's wait kept at ``key``, oldest first."""
        return list(self._wait_s.get(key, ()))

    def wait_s_at(self, key: WaitKey) -> Optional[float]:
        """The expected wait kept at ``key``, or None (fewer than two measured there)."""
        return self._low(self._wait_s, key)

    def recompute_s(self, tokens: int, others: int) -> Optional[float]:
        """What recomputing ``tokens`` tokens costs the requests it delays, or None."""
        line = self._decision_line()
        if line is None:
            return None
        fixed, per_token = line
        extra_steps = tokens // self.token_budget if self.token_budget else 0
        # within the budget a step's time by the curve where steps of that size were seen
        # (beyond them the line's slope plus two standard errors: the dearer side)
        within = min(tokens, self.token_budget or tokens)
        curve = self.curve.added_s(within)
        added = tokens * per_token if curve is None else curve / max(1, within) * tokens
        return (1 + max(0, others)) * (added + extra_steps * fixed)

    # ------------------------------------------------------------- deciding
    def pays(self, tokens: int, others: int) -> bool:
        """Whether loading ``tokens`` tokens is expected to cost no more than recomputing
        them (True while either side is unknown).  No side effect."""
        wait = self.expected_wait_s(others)
        recompute = self.recompute_s(tokens, others)
        return wait is None or recompute is None or wait <= recompute

    def decide(self, tokens: int, others: int) -> bool:
        """:meth:`pays`, counting the declines of a key: every ``explore_every``-th hit
        declined in a row at a key is loaded anyway, to measure its wait again, and so is
        the first declined once the key's wait is older than ``remeasure_after_s``."""
        return self.judge(tokens, others, decline=True)[1]

    def judge(self, tokens: int, others: int, decline: bool) -> tuple[bool, bool]:
        """``(pays, load)`` for a hit of ``tokens`` tokens: whether it pays, and whether to
        load it (always, unless ``decline``; then as :meth:`decide`)."""
        pays = self.pays(tokens, others)
        if not decline:
            return pays, True
        key = self.wait_key(others)
        # a lookup made to explore: the next hit judged is loaded (that request's, usually,
        # whichever key the step in flight gives it by now)
        credit, self._explore_credit = self._explore_credit, False
        if pays:
            self._declined_in_a_row[key] = 0
            return True, True
        if credit:
            return False, True
        return False, self._declined_unless_exploring(key, restart_at=0)

    def _declined_unless_exploring(self, key: WaitKey, restart_at: int) -> bool:
        """Count one more decline in a row at ``key``; True (explore: go ahead) when it is
        the ``explore_every``-th or the key's wait is older than ``remeasure_after_s``, the
        run then restarting at ``restart_at`` (and the key's age at 0: one hit explores,
        not every hit until its wait is measured)."""
        self._declined_in_a_row[key] += 1
        if self._declined_in_a_row[key] < self.explore_every and not self._stale(key):
            return False
        self._declined_in_a_row[key] = restart_at
        if self._last_step_at is not None:
            self._measured_at[key] = self._last_step_at
        return True

    def _stale(self, key: WaitKey) -> bool:
        """Whether ``key``'s wait is older than ``remeasure_after_s`` (on the steps' clock)."""
        now, measured = self._last_step_at, self._measured_at.get(key)
        return now is not None and measured is not None and now - measured > self.remeasure_after_s

    def worth_looking_up(self, tokens: int, others: int, lookup_pending: bool) -> bool:
        """Whether a request whose candidate blocks hold ``tokens`` tokens is worth its
        lookup: a hit's wait, plus the lookup's expected wait while it is not answered yet,
        no more than recomputing all of them.  Counted like :meth:`decide` (a skip is a
        decline at its key: every ``explore_every``-th one is looked up anyway, and the
        key's next hit loaded, so that its wait is measured again)."""
        key = self.wait_key(others)
        wait, recompute = self.wait_s_at(key), self.recompute_s(tokens, others)
        lookup = (self._low(self._lookup_s, key) or 0.0) if lookup_pending else 0.0
        if wait is None or recompute is None or wait + lookup <= recompute:
            return True
        if self._stale(key):
            # the key's next hit judged is loaded to measure it again (:meth:`judge`): the
            # lookup is made and uses nothing up -- at C1 every first ask of a prompt is
            # looked up and finds no hit; spending the key's one exploration on such a
            # lookup declined every follow-up for the next ``remeasure_after_s`` (H100,
            # session 34: 16 of 16 hits declined on a wait learned 17 s earlier)
            return True
        # exploring: the next hit judged not paying is loaded (this request's, usually; by
        # then the step in flight, and so its key, may have changed); a credit not yet
        # spent on a hit stays until one is judged
        explore = self._declined_unless_exploring(key, restart_at=0)
        self._explore_credit = self._explore_credit or explore
        return explore

    def figures(self) -> Dict[str, int]:
        """The estimates as whole numbers for the counters (0 until known; a counter keeps
        the last known one): prefill ns per token, fixed µs per step, a hit's expected wait
        (µs) at the latest measured hit's key."""
        line = self.step_line()
        key = self._last_key
        window = self._wait_s.get(key) if key is not None else None
        wait = min(window) if window else None  # (shown from the first sample on)
        return {"cost_prefill_ns_per_token": round(1e9 * line[1]) if line else 0,
                "cost_step_fixed_us": round(1e6 * line[0]) if line else 0,
                "cost_hit_wait_us": round(1e6 * wait) if wait is not None else 0}
