"""How many tokens to draft for a request this step, from its recent acceptance.

Verification is not free on a CPU: a forward pass over 1 + k tokens costs cost(k) times a one-token
step. With per-draft acceptance rate a, a step with k drafts emits (1 - a^(k+1)) / (1 - a) tokens on
average (Leviathan et al. 2023), so the k that maximises tokens per unit of cost is picked; when no k
beats plain decoding the request drafts nothing, probing with one draft now and then so a request whose
text turns repetitive gets speculation back.

cost(k) is measured: the runner times every size of step before the first request (on a dummy context;
ModelRunner.calibrate_step_costs) and then every step that verifies one request alone, and the ratio of a
(1 + k)-token step to a one-token step replaces the linear prior 1 + c * k (the prior stays for an engine
that was not calibrated, until both sizes were seen a few times). On a shared host single steps are often
slowed by other work: a live timing moves its size's average by at most 10% of it, and cost(k) is never
below cost(k - 1) (sizes are timed apart). The curve depends on the kernels, the machine and the context
length (with oneDNN linears it jumps at 7 rows; with specserve's GEMM and chunked attention it rises ~2% per
token at ~1k tokens of context, most of it attention).
The proposer's own time per draft token is added (tens of microseconds for a lookup, a forward pass of
the drafter per token for draft_model); a stalled call raises it by at most a tenth. A price that
nothing re-measures (a step size no request is given, the drafting time of an option no request uses)
returns toward its calibrated or prior value, so a price raised on a busy moment is tried again instead of
keeping that size or option out for good.

With several requests the step is fitted as fixed + per_token * tokens over recent steps, and a draft
costs per_token against the request's share of a plain step, (fixed + per_token * requests) / requests. At
one request the weights' memory traffic (fixed) dominates and drafts are cheap; at 32 requests the step
is mostly compute-bound, a draft costs about half a request's share (fitted), and only requests that
accept a lot keep drafting. Before a fit the calibration prices a step of N requests (its plain step, and
a draft row at what a second token per request added), or without one the batch-1 prior scaled to the
batch (a row's share of a one-token step, r, gives N r / (1 + N r) per draft at N requests); every 8th
step decodes plainly while the steps are too alike in size to fit (or, at one request, until a one-token
step is timed). With several requests a draft must promise BATCH_MIN_GAIN over plain decoding.

A request's expected tokens use the number of drafts it usually gets (a lookup often finds fewer than it
is asked for), and when no request's draft pays, the runner does no drafting work at all.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specserve.spec_decode.step_pricing import DEFAULT_COST_PER_DRAFT, STALE_AFTER, LinearStepFit, StepCosts, staleness

PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.6, 2.0  # optimistic start: new requests draft
DECAY = 0.8  # weight of the history at each verification: adapts within a few steps
# A new request starts from the engine's own recent acceptance when that is higher than the prior: a
# drafter that proved good (an int8 self-draft of the target accepts ~95% of its drafts) is not priced out of
# every new request by the generic prior.
ENGINE_DECAY = 0.98  # weight of the history per verification in the engine-wide rate: ~50 verifications
MEASURED_TRIALS = 10.0  # tried drafts (decayed) after which the engine-wide rate of an auto option is trusted
PROBE_EVERY = 8  # steps without drafting before one probing draft, when a draft is cheap
# A probe's extra cost (cost(1) - 1; for a draft model also its catch-up on the tokens since its last
# call) is spread over the idle steps before it: a drafter whose draft costs c steps probes at most every
# c / PROBE_BUDGET idle steps, so probing costs a request that stopped drafting ~1% (prompt lookup, c ~0.02,
# keeps PROBE_EVERY; an int8 self-draft at c ~0.5 probes every ~50 steps instead of every 8).
PROBE_BUDGET = 0.01
DRAFTING_EMA = 0.8  # weight of the history in the proposer's seconds per draft token
# A drafting time counts at most this many times the running value: a call that a stall (the collector,
# other work on the host) made 100x slower would otherwise price a lookup out of every later step.
DRAFTING_CLIP = 1.5
RELAX = 0.98  # per step, an option a request is not using drifts toward the engine's rate for it (auto)
# With several requests a draft must promise this much over plain decoding: a batched step's price is a fit
# over noisy timings, and a request's share of the gain is small, so a marginal draft is as likely a loss
# (at 16 requests in flight, prompt lookup drafting whenever a draft promises any gain drafts in 14% of
# steps and runs at 0.91-0.97x the speed of plain decoding).
BATCH_MIN_GAIN = 1.05
CALIBRATE_EVERY = 8  # a plain step this often while batched steps are all alike in size
MAX_PROBE_COST = 0.5  # no probing when one draft costs this much of a step share (a busy, compute-bound batch)


@dataclass
class AcceptanceStats:
    accepted: float = PRIOR_ACCEPTANCE * PRIOR_WEIGHT
    trials: float = PRIOR_WEIGHT
    proposed: float | None = None  # drafts a round as proposed (a lookup often finds fewer than asked)

    @property
    def rate(self) -> float:
        return self.accepted / self.trials

    def record(self, num_drafts: int, num_accepted: int, decay: float = DECAY) -> None:
        """Drafts are tried in order until the first rejection: a accepted of min(a + 1, n) tried."""
        tried = min(num_accepted + 1, num_drafts)
        self.accepted = self.accepted * decay + num_accepted
        self.trials = self.trials * decay + tried
        self.proposed = num_drafts if self.proposed is None else decay * self.proposed + (1 - decay) * num_drafts

    def usual_length(self, k: int) -> int:
        """How many of k asked-for drafts a round is likely to bring (k until a round was seen)."""
        return k if self.proposed is None else max(1, min(k, round(self.proposed)))

    def relax(self, rate: float, keep: float = RELAX) -> None:
        """Move the rate a step toward `rate` (an option not in use is tried again in time)."""
        self.accepted = keep * self.accepted + (1.0 - keep) * rate * self.trials


def expected_tokens(rate: float, k: int) -> float:
    """Mean tokens emitted by one verification step with k drafts at per-draft acceptance `rate`."""
    if rate >= 1.0:
        return k + 1.0
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


def probe_interval(probe_cost: float) -> int:
    """Idle steps before a probing draft that costs `probe_cost` plain steps beyond a plain step."""
    return max(PROBE_EVERY, math.ceil(probe_cost / PROBE_BUDGET))


def best_num_drafts(rate: float, max_k: int, cost_per_draft: float = DEFAULT_COST_PER_DRAFT) -> int:
    """argmax over k in [0, max_k] of expected tokens per unit of step cost 1 + c * k (0: do not speculate)."""
    return best_num_drafts_for(rate, max_k, lambda k: 1.0 + cost_per_draft * k)


def best_num_drafts_for(rate: float, max_k: int, cost) -> int:
    """argmax over k in [0, max_k] of expected tokens per unit of cost(k) (cost(0) = 1)."""
    return best_in_table(rate, [cost(k) for k in range(max_k + 1)], max_k)


def max_tokens_per_cost(costs: Sequence[float], max_k: int) -> float:
    """The best tokens per unit of costs[k] over k in [1, max_k] if every draft were accepted (k + 1 tokens)."""
    return max(((k + 1) / costs[k] for k in range(1, max_k + 1)), default=0.0)


def best_in_table(rate: float, costs: Sequence[float], max_k: int) -> int:
    """argmax over k in [0, max_k] of expected tokens per unit of costs[k]; the first on ties."""
    best_k, best, tokens, term = 0, 1.0 / costs[0], 1.0, 1.0
    for k in range(1, max_k + 1):
        term *= rate
        tokens += term
        score = tokens / costs[k]
        if score > best:
            best_k, best = k, score
    return best_k


@dataclass(frozen=True)
class DraftOption:
    """One way to draft: the proposer of a fixed method, or one of the proposers `auto` chooses between."""

    name: str
    max_drafts: int  # its num_speculative_tokens
    # proposer seconds per draft token in plain steps, until measured
    prior_drafting_cost: float = 0.0


class DraftPolicy:
    """Per request and step: which option drafts and how many tokens, or none (see the module docstring).

    Options are ranked by expected tokens per unit of cost, each at its best draft length; only those
    that beat plain decoding are listed, so a proposer that finds nothing (a lookup without a match) hands
    the request to the next. With one option this is the draft length policy of a fixed method.
    """

    def __init__(self, options: Sequence[DraftOption] = (DraftOption("default", 32),),
                 cost_per_draft: float = DEFAULT_COST_PER_DRAFT, adaptive: bool = True) -> None:
        self.options = tuple(options)
        self.cost_per_draft = cost_per_draft
        self.adaptive = adaptive
        self.stats: dict[str, list[AcceptanceStats]] = {}  # per request, per option
        self.idle_steps: dict[str, int] = {}  # per request, steps since it last drafted
        self.engine_stats = [AcceptanceStats() for _ in self.options]  # all requests, for new ones' start
        self.step_costs = StepCosts(cost_per_draft)  # one-request steps, by size
        self.batch_fit = LinearStepFit()  # steps of several requests
        self.num_running = 0  # requests in the last step
        self.draft_seconds: list[float | None] = [None] * len(self.options)  # per option, per draft token
        self.drafted_at = [0] * len(self.options)  # per option, the step of its last timed drafting
        self.step_index = 0
        # per option, cost(k) for k = 0..max_drafts: the same for every request of a step, so computed once
        # per (requests running, measurements that moved a price), and every STALE_AFTER steps
        self._tables: tuple[tuple, list[list[float]], bool] | None = None
        self._measured = 0  # measurements seen that moved a price

    # ---- measurements --------------------------------------------------------------------
    def seed_step_costs(self, single: dict[int, float], batched: dict[int, tuple[float, float]]) -> None:
        """Step times measured before the first request (the runner's calibration): seconds of one
        request's step by its number of tokens, and by number of requests the seconds of a step adding
        one token and two tokens to each."""
        self.step_costs.seed(single)
        if batched:
            self.batch_fit.seed(batched)
        self._measured += 1

    def keep_step_prices(self, other: DraftPolicy) -> None:
        """Take `other`'s measured step prices (what a calibration gives), none of its request or acceptance
        history: a reset engine keeps what it measured of this machine."""
        self.step_costs, self.batch_fit = other.step_costs, other.batch_fit
        self._measured += 1

    def observe_step(self, num_requests: int, num_tokens: int, seconds: float) -> None:
        """The time of a decode or verification step (no prefill in it)."""
        self.num_running = num_requests
        if num_requests == 1:
            self.step_costs.observe(num_tokens, seconds)
            self._measured += 1
        elif self.batch_fit.observe(num_tokens, seconds):
            self._measured += 1

    def observe_drafting(self, num_draft_tokens: int, seconds: float, option: int = 0) -> None:
        """A proposer's time for the drafts of one step: free for prompt lookup, k forward passes of a
        second model for draft_model, which a draft must repay as much as its verification."""
        if num_draft_tokens > 0:
            self._measured += 1
            per_token = seconds / num_draft_tokens
            old = self.draft_seconds[option]
            if old is not None:  # a stalled call moves the price a little only
                per_token = DRAFTING_EMA * old + (1 - DRAFTING_EMA) * min(per_token, DRAFTING_CLIP * old)
            self.draft_seconds[option] = per_token
            self.drafted_at[option] = self.step_index

    def record(self, req_id: str, num_drafts: int, num_accepted: int, option: int = 0) -> None:
        if num_drafts:
            self._request_stats(req_id)[option].record(num_drafts, num_accepted)
            self.engine_stats[option].record(num_drafts, num_accepted, ENGINE_DECAY)

    def forget(self, req_id: str) -> None:
        self.stats.pop(req_id, None)
        self.idle_steps.pop(req_id, None)

    # ---- decisions -----------------------------------------------------------------------
    def drafts_this_step(self, num_requests: int) -> bool:
        """False for a plain calibration step, every CALIBRATE_EVERY-th step while a draft cannot be priced
        from measurements: one request with no timed one-token step yet, or several whose recent steps are
        too alike in size for the fit (the plain step gives the other point)."""
        self.step_index += 1
        if not self.adaptive or self.step_index % CALIBRATE_EVERY:
            return True
        if num_requests == 1:  # one request that always drafts never times a one-token step
            return self.step_costs.samples.get(1, 0) >= StepCosts.MIN_SAMPLES
        return not self.batch_fit.lacks_spread()

    def plan(self, req_id: str, max_k: int) -> list[tuple[int, int]]:
        """[(option, number of drafts)] for this step, best first; [] to decode plainly.

        max_k caps every option (the request's own num_speculative_tokens, room left in max_model_len).
        Seeded requests are planned like the others: their tokens do not depend on what is drafted."""
        caps = [min(o.max_drafts, max_k) for o in self.options]
        if not self.adaptive:
            return [(i, k) for i, k in enumerate(caps) if k > 0]
        tables, any_pays = self._cost_tables()
        if not any_pays:
            return []  # not even drafts that are always accepted would repay their cost (nor would a probe)
        least = self._least_gain()
        stats = self._request_stats(req_id)
        scored = []
        for i, cap in enumerate(caps):
            if cap <= 0:
                continue
            k = best_in_table(stats[i].rate, tables[i], cap)
            if k == 0:
                continue
            length = stats[i].usual_length(k)  # priced as the drafts it usually brings, not the k asked
            score = expected_tokens(stats[i].rate, length) / tables[i][length]
            if score >= least:
                scored.append((score, i, k))
        scored.sort(key=lambda s: -s[0])  # stable: ties keep the options' order
        if len(self.options) > 1:
            used = scored[0][1] if scored else -1
            for i, s in enumerate(stats):
                if i != used:  # toward what the option does for other requests lately
                    s.relax(self.engine_stats[i].rate)
        if scored:
            self.idle_steps[req_id] = 0
            return [(i, k) for _, i, k in scored]
        return self._probe(req_id, caps, tables)

    def draft_costs(self, option: int, max_drafts: int) -> list[float]:
        """cost(n) of drafting and verifying n tokens with `option` in one step, n = 0..max_drafts, in plain
        steps (as plan prices chains; a tree prices its nodes by it)."""
        verify = (self.step_costs.table(max_drafts).__getitem__ if self.num_running <= 1
                  else self._verify_cost())
        cost = self._option_cost(option, verify)
        return [cost(n) for n in range(max_drafts + 1)]

    def _least_gain(self) -> float:
        """Expected tokens per unit of cost a draft must promise: more than plain decoding, with a margin
        when several requests share the step."""
        return 1.0 if self.num_running <= 1 else BATCH_MIN_GAIN

    def num_drafts(self, req_id: str, max_k: int) -> int:
        """The draft length of a one-option policy (0: decode plainly this step)."""
        plan = self.plan(req_id, max_k)
        return plan[0][1] if plan else 0

    def _probe(self, req_id: str, caps: list[int], tables: list[list[float]]) -> list[tuple[int, int]]:
        """One draft from the cheapest option now and then, so a request whose text turns predictable
        gets speculation back, unless a draft costs so much that no acceptance could repay it."""
        idle = self.idle_steps[req_id] = self.idle_steps.get(req_id, 0) + 1
        usable = [i for i, cap in enumerate(caps) if cap > 0]
        if not usable:
            return []
        cheapest = min(usable, key=lambda i: tables[i][1])
        probe_cost = tables[cheapest][1]
        if self.num_running <= 1 and not self.step_costs.is_live(2):  # a draft's price from the calibration
            probe_cost = min(probe_cost, 1.0 + self.cost_per_draft)  # alone, which a busy moment may have
            # inflated, does not forbid the probe that would time it
        if idle >= probe_interval(probe_cost - 1.0) and probe_cost < 1.0 + MAX_PROBE_COST:
            self.idle_steps[req_id] = 0
            return [(cheapest, 1)]
        return []

    def _request_stats(self, req_id: str) -> list[AcceptanceStats]:
        stats = self.stats.get(req_id)
        if stats is None:
            stats = self.stats[req_id] = [AcceptanceStats(accepted=self._start_rate(i) * PRIOR_WEIGHT)
                                          for i in range(len(self.options))]
        return stats

    def _start_rate(self, option: int) -> float:
        """A new request starts from the engine's own recent acceptance when that beats the prior. Among
        several options it starts from the engine's rate for each once that is measured: an optimistic
        start would have every new request try the lookups (often accepted ~30%) before a drafter that is
        accepted ~95%."""
        engine = self.engine_stats[option]
        if len(self.options) > 1 and engine.trials >= MEASURED_TRIALS:
            return engine.rate
        return max(PRIOR_ACCEPTANCE, engine.rate)

    def _drafting_cost(self, option: int, plain_seconds: float | None) -> float:
        """Proposer time per draft token relative to a request's plain step: the prior until measured, and
        back toward it while the option does no drafting (STALE_KEEP)."""
        seconds, prior = self.draft_seconds[option], self.options[option].prior_drafting_cost
        if seconds is None or not plain_seconds:
            return prior
        return prior + (seconds / plain_seconds - prior) * staleness(self.step_index - self.drafted_at[option])

    def _cost_tables(self) -> tuple[list[list[float]], bool]:
        """Per option, cost(k) for k = 0..its max_drafts (drafting and verifying k tokens, in plain steps);
        with them, whether any option would pay if all its drafts were accepted."""
        # stale prices drift slowly (STALE_KEEP a step): rebuilding every STALE_AFTER steps follows them
        key = (self.num_running, self._measured, self.step_index // STALE_AFTER)
        if self._tables is None or self._tables[0] != key:
            verify = self._verify_cost()
            tables = []
            for i, option in enumerate(self.options):
                cost = self._option_cost(i, verify)
                tables.append([cost(k) for k in range(option.max_drafts + 1)])
            least = self._least_gain()
            self._tables = (key, tables, any(max_tokens_per_cost(t, len(t) - 1) >= least for t in tables))
        return self._tables[1], self._tables[2]

    def _verify_cost(self) -> Callable[[int], float]:
        """cost(k) of verifying k drafts for one request of the current step, in plain steps, measured
        where possible."""
        if self.num_running <= 1:
            return self.step_costs.table(max(o.max_drafts for o in self.options)).__getitem__
        per_draft = self.batch_fit.draft_cost(self.num_running)
        if per_draft is None:  # before a fit: a token's share of a one-request step, scaled to this batch
            row = self.step_costs.relative(1) - 1.0  # seconds of a row over a one-token step's (its fixed part)
            per_draft = self.num_running * row / (1.0 + self.num_running * row)
        return lambda k: 1.0 + per_draft * k

    def _option_cost(self, option: int, verify: Callable[[int], float]) -> Callable[[int], float]:
        """cost(k) of drafting k tokens with `option` and verifying them, in plain steps."""
        plain = self.step_costs.seconds.get(1) if self.num_running == 1 else self.batch_fit.share(self.num_running)
        drafting = self._drafting_cost(option, plain)
        return lambda k: verify(k) + drafting * k
