"""What a replica's steps cost, measured from its own step timings: the figures a router trades
a cached prefix against load with, in seconds, whatever the model, hardware or traffic.

Every step the ledger observes (prefill tokens, decoding sequences, seconds the step occupied);
a least-squares fit with exponential forgetting gives

    step seconds = base + prefill_tokens / prefill_tokens_per_s + decode_seqs * step_s_per_seq

A step costs a few multiplications (the fit keeps decayed sums, solved only when asked, once a
status write). A term the recent steps do not determine (no prefill seen, no decoding seen) stays
unknown (0) rather than guessed; a term the fit makes negative (noise) is dropped and the rest
refitted, as `benchmarks/routing_real.py: calibrate` does. The queue wait is a decayed mean of
each request's wait from arrival to admission.
"""

from __future__ import annotations

from dataclasses import dataclass

# Half-lives, in observations: long enough to average a step's noise, short enough to follow a
# change of traffic (a burst of long prompts) within a few seconds of steps.
STEP_HALF_LIFE = 256
QUEUE_HALF_LIFE = 32
# A term counts as determined once this much decayed weight of steps exercised it.
MIN_STEPS = 3.0


@dataclass(frozen=True, slots=True)
class StepCosts:
    """Seconds, as measured; 0 where not measured yet (see `StepCostEstimator`)."""

    prefill_tokens_per_s: float = 0.0
    step_s_per_seq: float = 0.0
    step_base_s: float = 0.0
    queue_wait_s: float = 0.0
    steps: int = 0  # steps observed so far

    @property
    def prefill_s_per_token(self) -> float:
        return 1.0 / self.prefill_tokens_per_s if self.prefill_tokens_per_s > 0 else 0.0


class StepCostEstimator:
    def __init__(
        self, step_half_life: float = STEP_HALF_LIFE, queue_half_life: float = QUEUE_HALF_LIFE
    ) -> None:
        self._keep = 0.5 ** (1.0 / step_half_life)
        self._queue_keep = 0.5 ** (1.0 / queue_half_life)
        self._queue_sum = 0.0
        self._queue_weight = 0.0
        self.restart()

    def restart(self, skip_steps: int = 0) -> None:
        """Forget every step: the workers changed, and the old ones' speed says nothing of the
        new ones'. The next `skip_steps` steps are left out too: a fresh worker's first forward
        passes warm up (allocations, kernel selection) and can take seconds, which a fit of a
        few dozen steps would read as a slow replica for minutes, and a router would stop
        sending it the requests that could correct it. The queue wait is kept: it is the
        replica's, not its workers'."""
        # Decayed sums of x x^T (upper triangle) and x y for x = (1, prefill/1000, decode/100):
        # scaled so that the three columns are of like size and the 3x3 solve stays well posed.
        self._xx = [0.0] * 6  # 11 12 13 22 23 33
        self._xy = [0.0] * 3
        self._prefill_weight = 0.0  # decayed count of steps that prefilled
        self._decode_weight = 0.0
        self.steps = 0
        self._skip = skip_steps  # steps still to leave out
        self._estimate: StepCosts | None = None  # until the next observation

    def observe_step(self, prefill_tokens: int, decode_seqs: int, seconds: float) -> None:
        if seconds <= 0 or (prefill_tokens <= 0 and decode_seqs <= 0):
            return
        if self._skip:
            self._skip -= 1
            return
        k = self._keep
        p, d = prefill_tokens / 1000.0, decode_seqs / 100.0
        xx, xy = self._xx, self._xy
        xx[0] = xx[0] * k + 1.0
        xx[1] = xx[1] * k + p
        xx[2] = xx[2] * k + d
        xx[3] = xx[3] * k + p * p
        xx[4] = xx[4] * k + p * d
        xx[5] = xx[5] * k + d * d
        xy[0] = xy[0] * k + seconds
        xy[1] = xy[1] * k + p * seconds
        xy[2] = xy[2] * k + d * seconds
        self._prefill_weight = self._prefill_weight * k + (1.0 if prefill_tokens else 0.0)
        self._decode_weight = self._decode_weight * k + (1.0 if decode_seqs else 0.0)
        self.steps += 1
        self._estimate = None

    def observe_queue_wait(self, seconds: float) -> None:
        k = self._queue_keep
        self._queue_sum = self._queue_sum * k + max(seconds, 0.0)
        self._queue_weight = self._queue_weight * k + 1.0
        self._estimate = None

    def estimate(self) -> StepCosts:
        if self._estimate is None:
            self._estimate = self._fit()
        return self._estimate

    def _fit(self) -> StepCosts:
        queue = self._queue_sum / self._queue_weight if self._queue_weight else 0.0
        terms = [0]
        if self._prefill_weight >= MIN_STEPS:
            terms.append(1)
        if self._decode_weight >= MIN_STEPS:
            terms.append(2)
        coef = [0.0, 0.0, 0.0]
        while terms:
            fitted = _solve(self._xx, self._xy, terms)
            if fitted is None:
                terms.pop()
                continue
            if min(fitted) >= 0:
                for term, value in zip(terms, fitted, strict=True):
                    coef[term] = value
                break
            terms.pop(fitted.index(min(fitted)))
        per_token = coef[1] / 1000.0
        return StepCosts(
            prefill_tokens_per_s=1.0 / per_token if per_token > 0 else 0.0,
            step_s_per_seq=coef[2] / 100.0,
            step_base_s=coef[0],
            queue_wait_s=queue,
            steps=self.steps,
        )


_INDEX = {(0, 0): 0, (0, 1): 1, (0, 2): 2, (1, 1): 3, (1, 2): 4, (2, 2): 5}


def _solve(xx: list[float], xy: list[float], terms: list[int]) -> list[float] | None:
    """The normal equations restricted to `terms`, by Gaussian elimination (at most 3x3);
    None when singular."""
    n = len(terms)
    a = [[xx[_INDEX[(min(i, j), max(i, j))]] for j in terms] + [xy[i]] for i in terms]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12 * max(1.0, abs(a[0][0])):
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for row in range(n):
            if row != col:
                factor = a[row][col] / a[col][col]
                for k in range(col, n + 1):
                    a[row][k] -= factor * a[col][k]
    return [a[i][n] / a[i][i] for i in range(n)]


# The eviction head a ledger publishes: what its queued prefills will allocate, plus a few
# steps' worth of the token budget for what routers send before the next status, walked from
# the front of the free queue (at most MAX_EVICTION_HEAD positions: ~12 bytes each on the wire).
EVICTION_HEAD_STEPS = 4
MAX_EVICTION_HEAD = 2048
# How often the ledger writes its eviction head (a small key of its own, more often than its
# status: under load the front of the free queue turns over within a second).
EVICTION_INTERVAL_S = 0.25


def eviction_horizon(
    queued_prefill_tokens: int, max_num_batched_tokens: int, block_size: int
) -> int:
    """How many free-queue positions a ledger's eviction head covers."""
    tokens = queued_prefill_tokens + EVICTION_HEAD_STEPS * max_num_batched_tokens
    return min(-(-tokens // block_size), MAX_EVICTION_HEAD)
