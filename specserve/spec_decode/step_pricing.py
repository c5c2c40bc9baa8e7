"""What a step costs, as the runner measures it: single-request steps by size (StepCosts, cost(k) relative
to a one-token step) and steps of several requests as fixed + per_token * tokens (LinearStepFit). The draft
policy (policy.py) prices drafts from them.
"""
from __future__ import annotations

import math

# A draft row costs ~3.5% of a one-token step on the default model: with SmolLM2 at batch 1 on ~1k-token
# summarization contexts, a step verifying 4 drafts takes ~1.14x a one-token step on a 2-core CPU, the C
# attention kernel reading the block pool in place (gathering the blocks for SDPA makes each row dearer).
DEFAULT_COST_PER_DRAFT = 0.035
# A price nothing re-measures drifts back toward its prior: after STALE_AFTER steps without an observation,
# per further step a measured drafting time keeps STALE_KEEP of its distance from the prior, and a step
# size's measured cost of its distance from the calibrated shape (a half-life of ~70 steps). A price that
# turned prohibitive on a busy moment would otherwise never be tried again, so never corrected.
STALE_AFTER, STALE_KEEP = 16, 0.99


def staleness(age: int) -> float:
    """The weight a measurement last made `age` steps ago keeps against its prior."""
    return STALE_KEEP ** max(age - STALE_AFTER, 0)


class StepCosts:
    """Seconds of single-request steps by number of tokens (moving averages), as cost(k) relative to one."""

    MIN_SAMPLES = 3  # observations of both step sizes before a measured ratio is trusted
    EMA = 0.8
    CLIP = 0.1  # an observation counts at most this far (relative) from the running value

    def __init__(self, cost_per_draft: float = DEFAULT_COST_PER_DRAFT) -> None:
        self.cost_per_draft = cost_per_draft
        self.seconds: dict[int, float] = {}
        self.samples: dict[int, int] = {}
        self.anchor: dict[int, float] = {}  # calibrated cost(k) (seed), what an unobserved size returns to
        self.clock = 0  # observations of any size
        self.seen: dict[int, int] = {}  # clock at each size's last observation
        self.live: set[int] = set()  # sizes timed in live steps (not only by the calibration)

    def observe(self, num_tokens: int, seconds: float) -> None:
        self.clock += 1
        self.seen[num_tokens] = self.clock
        if num_tokens not in self.samples:  # the first step of a size builds oneDNN kernels for it: skip
            self.samples[num_tokens] = 0
            return
        old = self.seconds.get(num_tokens)
        if old is not None and num_tokens not in self.live:  # a calibrated size's first live step: a
            self.seconds[num_tokens] = min(old, seconds)    # calibration on a busy moment must not stick
        elif old is not None:  # a step that other work on the host slowed (or a quick one) moves it a little only
            seconds = min(max(seconds, old * (1 - self.CLIP)), old * (1 + self.CLIP))
            self.seconds[num_tokens] = self.EMA * old + (1 - self.EMA) * seconds
        else:
            self.seconds[num_tokens] = seconds
        self.live.add(num_tokens)
        self.samples[num_tokens] = self.samples.get(num_tokens, 0) + 1

    def seed(self, seconds: dict[int, float]) -> None:
        """Calibrated seconds by step size, trusted at once; later steps move them like any other."""
        for num_tokens, value in seconds.items():
            self.seconds[num_tokens] = value
            self.samples[num_tokens] = max(self.samples.get(num_tokens, 0), self.MIN_SAMPLES)
            self.seen[num_tokens] = self.clock
        one = seconds.get(1)
        if one:
            self.anchor = {n - 1: max(value / one, 1.0) for n, value in seconds.items() if n > 1}

    def relative(self, k: int) -> float:
        """cost of verifying k drafts, in one-token steps: never less than verifying fewer (sizes are timed
        apart, so noise can put a larger step below a smaller one)."""
        return self.table(k)[k]

    def table(self, max_k: int) -> list[float]:
        """relative(k) for k = 0..max_k, in one pass."""
        costs, top = [], 1.0
        for k in range(max_k + 1):
            top = max(top, self._ratio(k))
            costs.append(top)
        return costs

    def is_live(self, num_tokens: int) -> bool:
        """Whether a live step of this size has been timed (a calibrated price is only provisional)."""
        return num_tokens in self.live

    def _ratio(self, k: int) -> float:
        if k == 0:
            return 1.0
        prior = self.anchor.get(k, 1.0 + self.cost_per_draft * k)
        ratio = prior
        if min(self.samples.get(1, 0), self.samples.get(1 + k, 0)) >= self.MIN_SAMPLES:
            measured = max(self.seconds[1 + k] / self.seconds[1], 1.0)
            ratio = prior + (measured - prior) * staleness(self.clock - self.seen[1 + k])
        if 1 + k not in self.live:  # calibrated only: no dearer per draft than the sizes live steps confirmed
            slope = self._live_slope()
            if slope is not None:
                ratio = min(ratio, 1.0 + slope * k)
        return ratio

    def _live_slope(self) -> float | None:
        """The largest cost per draft token among the step sizes timed live, or None before any."""
        if 1 not in self.live:
            return None
        slopes = [(max(self.seconds[n] / self.seconds[1], 1.0) - 1.0) / (n - 1) for n in self.live if n > 1]
        return max(slopes) if slopes else None


class LinearStepFit:
    """seconds = fixed + per_token * tokens over recent multi-request steps (exponentially weighted least
    squares). While steps stop varying in size (as they do once drafting has stopped) the last slope made
    with enough spread is kept and the fixed part follows the recent steps."""

    DECAY = 0.97  # weight of the history per step: about the last 30 steps count
    MIN_WEIGHT = 8.0
    MIN_SPREAD = 1.5  # standard deviation of the step sizes, in tokens, needed to trust a slope

    def __init__(self, row_cost: float = DEFAULT_COST_PER_DRAFT) -> None:
        self.sums = [0.0] * 5  # weight, tokens, seconds, tokens^2, tokens * seconds
        self.fit: tuple[float, float] | None = None  # (fixed, per_token)
        # Before a fit: steps are taken as fixed * (1 + row_cost * tokens) (a row's share of a one-token
        # step, the batch-1 prior) and `fixed` follows the steps seen.
        self.row_cost = row_cost
        self.fixed_guess: float | None = None
        self.calibrated: dict[int, tuple[float, float]] = {}  # see seed()

    def observe(self, num_tokens: int, seconds: float) -> bool:
        """Add a step; whether the price of a step moved (the fit, or the prior's fixed part while nothing
        is calibrated: calibrated prices stay until a fit replaces them)."""
        x, y = float(num_tokens), seconds
        self.sums = [s * self.DECAY + v for s, v in zip(self.sums, (1.0, x, y, x * x, x * y))]
        fixed = y / (1.0 + self.row_cost * x)
        self.fixed_guess = fixed if self.fixed_guess is None else 0.8 * self.fixed_guess + 0.2 * fixed
        w, sx, sy, sxx, sxy = self.sums
        if w < self.MIN_WEIGHT:
            return not self.calibrated
        mean_x, mean_y = sx / w, sy / w
        var_x = sxx / w - mean_x * mean_x
        if var_x >= self.MIN_SPREAD ** 2:
            per_token = max((sxy / w - mean_x * mean_y) / var_x, 0.0)
            self.fit = (max(mean_y - per_token * mean_x, 0.0), per_token)
        elif self.fit is not None:  # the last slope, through the recent steps: a host that turns busy or quiet
            per_token = self.fit[1]  # moves the fixed part, and with it the price of a draft
            self.fit = (max(mean_y - per_token * mean_x, 0.0), per_token)
        return self.fit is not None or not self.calibrated

    def seed(self, calibrated: dict[int, tuple[float, float]]) -> None:
        """Calibrated steps by number of requests N: (seconds of N requests adding one token each, and two
        each). Until live steps of several sizes make a fit, a step of N requests is priced from them: its
        plain step interpolated between the calibrated N's, a draft token at the nearest pair's difference
        per request (a draft row's cost, which is less than a request's: no sampling, the request's KV read
        once for all its rows).

        A draft row's share of a step (two - one) / one is taken as never smaller at more requests than at
        fewer (each request's share of the weights' read shrinks, a row's arithmetic does not): a pair timed
        while other work slowed the one-token side alone (e.g. 9.5 against 9.6 ms at four requests, where a
        quiet host gives 6.1 against 8.4) would otherwise price drafts nearly free at that size."""
        self.calibrated, floor = {}, 0.0
        for n, (one, two) in sorted(calibrated.items()):
            floor = max(floor, (two - one) / one if one > 0 else 0.0)
            self.calibrated[n] = (one, one * (1.0 + floor))

    def _calibrated(self, num_requests: int) -> tuple[float, float] | None:
        """(seconds of a plain step of num_requests requests, seconds of one draft token) from the calibration."""
        if not self.calibrated:
            return None
        num_requests = max(num_requests, 1)
        sizes = list(self.calibrated)
        nearest = min(sizes, key=lambda n: abs(math.log(n / num_requests)))
        one, two = self.calibrated[nearest]
        per_draft = max(two - one, 0.0) / nearest
        below = [n for n in sizes if n <= num_requests]
        above = [n for n in sizes if n >= num_requests]
        if not below or not above:  # outside the calibrated sizes: a row per request from the nearest
            plain = one + per_draft * (num_requests - nearest)
        else:
            lo, hi = below[-1], above[0]
            t = 0.0 if hi == lo else (num_requests - lo) / (hi - lo)
            plain = (1 - t) * self.calibrated[lo][0] + t * self.calibrated[hi][0]
        return (plain, per_draft) if plain > 0 else None

    def lacks_spread(self) -> bool:
        """Whether recent steps varied too little in size to fit a slope (all requests drafting alike)."""
        w, sx, _, sxx, _ = self.sums
        return w == 0 or sxx / w - (sx / w) ** 2 < self.MIN_SPREAD ** 2

    def share(self, num_requests: int) -> float | None:
        """Seconds of one request's share of a plain step (one token each) of num_requests requests; before
        a fit, from the prior shape of a step, so a drafter's own time is priced from the first steps."""
        if self.fit is None:
            calibrated = self._calibrated(num_requests)
            if calibrated is not None:
                return calibrated[0] / max(num_requests, 1)
            if self.fixed_guess is None:
                return None
            return self.fixed_guess * (1.0 + self.row_cost * num_requests) / max(num_requests, 1)
        fixed, per_token = self.fit
        share = (fixed + per_token * num_requests) / max(num_requests, 1)
        return share if share > 0 else None

    def draft_cost(self, num_requests: int) -> float | None:
        """One draft token's verification cost relative to one request's share of a plain step of
        num_requests requests; None before a fit."""
        share = self.share(num_requests)
        if share is None:
            return None
        if self.fit is None:
            calibrated = self._calibrated(num_requests)
            return None if calibrated is None else calibrated[1] / share
        return self.fit[1] / share
