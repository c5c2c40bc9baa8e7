"""`auto`: suffix decoding, prompt lookup and one model drafter behind one Proposer.

The runner's DraftPolicy ranks the three per request and step by expected tokens per unit of cost, from
the request's acceptance of each and each one's measured drafting time, and hands the ranking over as
`DraftInputs.draft_plans`. Each request takes the first option of its plan that has a draft: a lookup is
asked for the requests it is the next choice of (microseconds each), the next option only where it found
nothing, and the model drafter runs once, for the requests that came to it. A request none of whose
options pays gets no drafting work.
"""
from __future__ import annotations

import time
from dataclasses import replace

from specserve.spec_decode.ngram import NgramProposer
from specserve.spec_decode.policy import DraftOption
from specserve.spec_decode.proposer import DraftInputs, DrafterNeeds, Drafts, TargetInfo, TargetStates
from specserve.spec_decode.suffix import SuffixProposer

# A model drafter's time per draft token, in target steps, until measured, where the drafter does not price
# itself from its weight bytes (DrafterNeeds.drafting_cost; EAGLE and Medusa heads): an int8 self-draft of a
# small fp32 model measured ~0.3 here at one request.
MODEL_PRIOR_DRAFTING_COST = 0.3
_STATES_ORDER = (TargetStates.NONE, TargetStates.ACCEPTED, TargetStates.ALL)


class AutoProposer:
    def __init__(self, spec_config, target: TargetInfo) -> None:
        from specserve.spec_decode.proposer import make_proposer

        def part(method: str, key: str, **extra):
            return replace(spec_config, method=method, num_speculative_tokens=spec_config.num_tokens_for(key),
                           drafter=None, **extra)

        lookups = {"model": None, "quantization": None}
        self.proposers = [SuffixProposer(part("suffix", "suffix", **lookups)),
                          NgramProposer(part("ngram", "ngram", **lookups))]
        options = [DraftOption("suffix", self.proposers[0].k), DraftOption("ngram", self.proposers[1].k)]
        self.num_lookups = 2
        if spec_config.drafter not in (None, "none"):
            model_config = part(spec_config.drafter, "model")
            self.proposers.append(make_proposer(model_config, target))
            options.append(DraftOption(spec_config.drafter, model_config.num_speculative_tokens,
                                       self.proposers[-1].needs.drafting_cost or MODEL_PRIOR_DRAFTING_COST))
        self.needs = _merged_needs([p.needs for p in self.proposers], tuple(options))

    def propose(self, inputs: DraftInputs) -> Drafts:
        size = len(inputs.req_ids)
        plans = inputs.draft_plans or [[(0, n)] if n else [] for n in inputs.num_drafts]
        drafts: list[list[int]] = [[] for _ in range(size)]
        sources: list[int | None] = [None] * size
        probs: list = [None] * size
        timings = []
        turn = [0] * size  # each request's place in its plan
        first = True
        while True:  # ask each lookup for the requests it is the next choice of
            # the first round calls every lookup: each sees every request (suffix keeps the histories for its
            # global cache) and the finished ones
            wanted: dict[int, list[int]] = {o: [0] * size for o in range(self.num_lookups)} if first else {}
            for i, plan in enumerate(plans):
                if not drafts[i] and turn[i] < len(plan) and plan[turn[i]][0] < self.num_lookups:
                    option, k = plan[turn[i]]
                    wanted.setdefault(option, [0] * size)[i] = k
            if not wanted:
                break
            first = False
            for option, want in wanted.items():
                for i, tokens in enumerate(self._run(option, inputs, want, timings).token_ids):
                    if want[i]:
                        if tokens:
                            drafts[i], sources[i] = tokens, option
                        turn[i] += 1
        model_wanted = [plan[turn[i]][1] if not drafts[i] and turn[i] < len(plan) else 0
                        for i, plan in enumerate(plans)]  # the lookups found nothing: the model drafter
        for option in range(self.num_lookups, len(self.proposers)):  # called every step: it may keep state
            out = self._run(option, inputs, model_wanted, timings)
            for i, tokens in enumerate(out.token_ids):
                if tokens:
                    drafts[i], sources[i] = tokens, option
                    probs[i] = out.probs[i] if out.probs is not None else None
        return Drafts(drafts, probs if any(p is not None for p in probs) else None, sources, timings)

    def _run(self, option: int, inputs: DraftInputs, wanted: list[int], timings: list) -> Drafts:
        start = time.perf_counter()
        out = self.proposers[option].propose(inputs.asking(wanted))
        if any(wanted):
            timings.append((option, sum(map(len, out.token_ids)), time.perf_counter() - start))
        return out


def _merged_needs(parts: list[DrafterNeeds], options: tuple[DraftOption, ...]) -> DrafterNeeds:
    """What the parts need together: at most one of them (the model drafter) reads states or keeps KV."""
    return DrafterNeeds(
        target_states=max((p.target_states for p in parts), key=_STATES_ORDER.index),
        aux_layers=next((p.aux_layers for p in parts if p.aux_layers), ()),
        kv=next((p.kv for p in parts if p.kv is not None), None),
        num_lookahead_tokens=max(p.num_lookahead_tokens for p in parts),
        reads_target_kv=any(p.reads_target_kv for p in parts),
        options=options)
