"""How many tokens to draft for a request this step, from its recent acceptance.

Verification is not free on a CPU: a forward pass over 1 + k tokens costs cost(k) times a one-token
step. With per-draft acceptance rate a, a step with k drafts emits (1 - a^(k+1)) / (1 - a) tokens on
average (Leviathan et al. 2023), so the k that maximises tokens per unit of cost is picked; when no k
beats plain decoding the request drafts nothing, probing with one draft now and then so a request whose
text turns repetitive gets speculation back.

cost(k) is measured: the runner reports the time of every step that verifies one request alone, and
once both a one-token step and a (1 + k)-token step have been seen a few times, their ratio replaces the
linear prior 1 + c * k. The curve is not linear here (oneDNN switches kernels at 7 rows: 2-6 tokens cost
~1.1x a one-token step, 7-9 ~1.3x), and it depends on the machine and the context length. Steps with
several requests keep the prior (a draft's marginal cost is smaller there).
"""
from __future__ import annotations

from dataclasses import dataclass

# Measured on this CPU (SmolLM2, batch 1, ~1k-token summarization contexts): a step verifying 4 drafts
# took 1.14x a one-token step (28.3 vs 24.9 ms) once attention read the block pool in place, so each
# extra verified token adds ~3.5% (it was ~6% with gathered attention).
DEFAULT_COST_PER_DRAFT = 0.035
PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.6, 2.0  # optimistic start: new requests draft
DECAY = 0.8  # weight of the history at each verification: adapts within a few steps
PROBE_EVERY = 8  # steps without drafting before one probing draft


@dataclass
class AcceptanceStats:
    accepted: float = PRIOR_ACCEPTANCE * PRIOR_WEIGHT
    trials: float = PRIOR_WEIGHT
    idle_steps: int = 0

    @property
    def rate(self) -> float:
        return self.accepted / self.trials

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """Drafts are tried in order until the first rejection: a accepted of min(a + 1, n) tried."""
        tried = min(num_accepted + 1, num_drafts)
        self.accepted = self.accepted * DECAY + num_accepted
        self.trials = self.trials * DECAY + tried


def expected_tokens(rate: float, k: int) -> float:
    """Mean tokens emitted by one verification step with k drafts at per-draft acceptance `rate`."""
    if rate >= 1.0:
        return k + 1.0
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


def best_num_drafts(rate: float, max_k: int, cost_per_draft: float = DEFAULT_COST_PER_DRAFT) -> int:
    """argmax over k in [0, max_k] of expected tokens per unit of step cost 1 + c * k (0: do not speculate)."""
    return best_num_drafts_for(rate, max_k, lambda k: 1.0 + cost_per_draft * k)


def best_num_drafts_for(rate: float, max_k: int, cost) -> int:
    """argmax over k in [0, max_k] of expected tokens per unit of cost(k) (cost(0) = 1)."""
    scores = [expected_tokens(rate, k) / cost(k) for k in range(max_k + 1)]
    return max(range(max_k + 1), key=scores.__getitem__)


class StepCosts:
    """Seconds of single-request steps by number of tokens (moving averages), as cost(k) relative to one."""

    MIN_SAMPLES = 3  # observations of both step sizes before a measured ratio is trusted
    EMA = 0.8

    def __init__(self, cost_per_draft: float = DEFAULT_COST_PER_DRAFT) -> None:
        self.cost_per_draft = cost_per_draft
        self.seconds: dict[int, float] = {}
        self.samples: dict[int, int] = {}

    def observe(self, num_tokens: int, seconds: float) -> None:
        old = self.seconds.get(num_tokens)
        self.seconds[num_tokens] = seconds if old is None else self.EMA * old + (1 - self.EMA) * seconds
        self.samples[num_tokens] = self.samples.get(num_tokens, 0) + 1

    def relative(self, k: int) -> float:
        """cost of verifying k drafts, in one-token steps."""
        if k == 0:
            return 1.0
        if min(self.samples.get(1, 0), self.samples.get(1 + k, 0)) >= self.MIN_SAMPLES:
            return max(self.seconds[1 + k] / self.seconds[1], 1.0)
        return 1.0 + self.cost_per_draft * k


class DraftLengthPolicy:
    def __init__(self, cost_per_draft: float = DEFAULT_COST_PER_DRAFT, adaptive: bool = True) -> None:
        self.cost_per_draft = cost_per_draft
        self.adaptive = adaptive
        self.stats: dict[str, AcceptanceStats] = {}
        self.step_costs = StepCosts(cost_per_draft)
        self.num_running = 0  # requests in the last step: measured costs apply when it is one

    def observe_step(self, num_requests: int, num_tokens: int, seconds: float) -> None:
        """A decode or verification step's time; only steps of one request shape cost(k)."""
        self.num_running = num_requests
        if num_requests == 1:
            self.step_costs.observe(num_tokens, seconds)

    def num_drafts(self, req_id: str, max_k: int, seeded: bool = False) -> int:
        """seeded: the request samples from its own generator, whose draws depend on how many drafts each
        step verifies; it then follows the prior only, so its output depends on its own history alone and
        not on timings or batch-mates."""
        if not self.adaptive or max_k == 0:
            return max_k
        stats = self.stats.setdefault(req_id, AcceptanceStats())
        if self.num_running == 1 and not seeded:
            k = best_num_drafts_for(stats.rate, max_k, self.step_costs.relative)
        else:
            k = best_num_drafts(stats.rate, max_k, self.cost_per_draft)
        if k > 0:
            stats.idle_steps = 0
            return k
        stats.idle_steps += 1
        if stats.idle_steps >= PROBE_EVERY:
            stats.idle_steps = 0
            return 1
        return 0

    def record(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        if num_drafts:
            self.stats.setdefault(req_id, AcceptanceStats()).record(num_drafts, num_accepted)

    def forget(self, req_id: str) -> None:
        self.stats.pop(req_id, None)
