"""`auto`: suffix decoding, prompt lookup and one model drafter behind one Proposer.

The runner's DraftPolicy ranks the three per request and step by expected tokens per unit of cost, from
the request's acceptance of each and each one's measured drafting time, and hands the ranking over as
`DraftInputs.draft_plans`. Each request takes the first option of its plan that has a draft: a lookup is
asked for the requests it is the next choice of (microseconds each), the next option only where it found
nothing, and the model drafter runs once, for the requests that came to it. A request none of whose
options pays gets no drafting work.

A lookup a request does not use is still measured on it: every SHADOW_EVERY drafting steps the lookups it
did not ask are asked too (microseconds), and their drafts, never verified, are scored against the tokens
the request goes on to emit. A draft token is accepted exactly when it is the token the target emits
(greedy), or with the target's probability of it, which is also the chance the emitted token equals it
(sampling), so a shadow draft's matched prefix counts as its acceptance would have. Without this an
option that did badly for a while is never tried again on that request and its rate never recovers.
"""
from __future__ import annotations

import time
from dataclasses import replace

from specserve.spec_decode.ngram import NgramProposer
from specserve.spec_decode.policy import DraftOption
from specserve.spec_decode.proposer import DraftInputs, DrafterNeeds, Drafts, TargetInfo, TargetStates
from specserve.spec_decode.suffix import SuffixProposer
from specserve.spec_decode.tree import TREE_METHODS
from specserve.types import max_draft_tokens

# A model drafter's time per draft token, in target steps, until measured, where the drafter does not price
# itself from its weight bytes (DrafterNeeds.drafting_cost; EAGLE and Medusa heads): an int8 self-draft of a
# small fp32 model costs ~0.3 at one request.
MODEL_PRIOR_DRAFTING_COST = 0.3
SHADOW_EVERY = 4  # a request's drafting steps between two rounds of shadow drafts from its unused lookups
_STATES_ORDER = (TargetStates.NONE, TargetStates.ACCEPTED, TargetStates.ALL)


class AutoProposer:
    def __init__(self, spec_config, target: TargetInfo) -> None:
        from specserve.spec_decode.proposer import make_proposer

        def part(method: str, key: str, **extra):
            if method not in TREE_METHODS:  # drafts chains
                extra.update(draft_tree="chain", speculative_token_tree=None)
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
        for option, proposer in enumerate(self.proposers):  # trees price their nodes by their own option's costs
            if hasattr(proposer, "trees"):
                proposer.trees.option = option
        self.needs = _merged_needs([p.needs for p in self.proposers], tuple(options))
        # per request: the shadow drafts awaiting the tokens that score them, option -> (index of the first
        # draft token in the history, drafts), and its drafting steps since its last shadow round
        self._shadows: dict[str, dict[int, tuple[int, list[int]]]] = {}
        self._since_shadow: dict[str, int] = {}
        # per lookup, the history list of each request it has seen
        self._seen: list[dict[str, list[int]]] = [{} for _ in range(self.num_lookups)]

    def propose(self, inputs: DraftInputs) -> Drafts:
        size = len(inputs.req_ids)
        plans = inputs.draft_plans or [[(0, n)] if n else [] for n in inputs.num_drafts]
        for rid in inputs.finished_req_ids:
            self._shadows.pop(rid, None)
            self._since_shadow.pop(rid, None)
            for seen in self._seen:
                seen.pop(rid, None)
        scored = self._score_shadows(inputs)
        shadowing = [bool(plan) and self._shadow_due(rid) for rid, plan in zip(inputs.req_ids, plans)]
        drafts: list[list[int]] = [[] for _ in range(size)]
        sources: list[int | None] = [None] * size
        probs: list = [None] * size
        timings = []
        # each lookup's drafts this step per request (None: not asked), and each request's place in its plan
        found: list[list[list[int] | None]] = [[None] * size for _ in range(self.num_lookups)]
        trees: list = [None] * size  # a lookup's draft tree, where it gave one (found holds its first path)
        found_trees: dict[tuple[int, int], object] = {}
        turn = [0] * size
        # The first round asks each request's first choice, and every lookup when the request's shadow round
        # is due; it calls every lookup when there are finished requests or requests (histories) it has not
        # seen, as each must see those (suffix keeps a history for its global cache). Later rounds ask the
        # next choice of requests with nothing yet.
        visit = bool(inputs.finished_req_ids)
        wanted: dict[int, list[int]] = {o: [0] * size for o in range(self.num_lookups)}
        for i, plan in enumerate(plans):
            if shadowing[i]:
                room = max_draft_tokens(len(inputs.token_ids[i]), inputs.max_model_len)
                for option in range(self.num_lookups):
                    if option not in self._shadows.get(inputs.req_ids[i], ()):
                        wanted[option][i] = min(self.needs.options[option].max_drafts, room)
            if plan and plan[0][0] < self.num_lookups:
                wanted[plan[0][0]][i] = max(wanted[plan[0][0]][i], plan[0][1])
        wanted = {o: want for o, want in wanted.items() if visit or any(want) or self._unseen(o, inputs)}
        while wanted:
            for option, want in wanted.items():
                self._seen[option].update(zip(inputs.req_ids, inputs.token_ids))
                out = self._run(option, inputs, want, timings)
                for i, tokens in enumerate(out.token_ids):
                    if want[i]:
                        tree = out.trees[i] if out.trees is not None else None
                        if tree is not None:
                            found_trees[option, i] = tree
                            tokens = [tree.tokens[v] for v in tree.first_path()]
                        found[option][i] = tokens
            wanted = {}
            for i, plan in enumerate(plans):  # take the first choice that has a draft, or ask the next
                while not drafts[i] and turn[i] < len(plan) and plan[turn[i]][0] < self.num_lookups:
                    option, k = plan[turn[i]]
                    if found[option][i] is None:
                        wanted.setdefault(option, [0] * size)[i] = k
                        break
                    if found[option][i]:
                        drafts[i], sources[i] = found[option][i][:k], option
                        trees[i] = found_trees.get((option, i))
                        if trees[i] is not None:
                            drafts[i] = list(trees[i].tokens)
                    else:
                        turn[i] += 1
        model_wanted = [plan[turn[i]][1] if not drafts[i] and turn[i] < len(plan) else 0
                        for i, plan in enumerate(plans)]  # the lookups found nothing: the model drafter
        self._keep_shadows(inputs, found, sources, shadowing)
        for option in range(self.num_lookups, len(self.proposers)):  # called every step: it may keep state
            out = self._run(option, inputs, model_wanted, timings)
            for i, tokens in enumerate(out.token_ids):
                if tokens:
                    drafts[i], sources[i] = tokens, option
                    probs[i] = out.probs[i] if out.probs is not None else None
        return Drafts(drafts, probs if any(p is not None for p in probs) else None, sources, timings, scored,
                      trees if any(t is not None for t in trees) else None)

    def _unseen(self, option: int, inputs: DraftInputs) -> bool:
        seen = self._seen[option]
        return any(seen.get(rid) is not history for rid, history in zip(inputs.req_ids, inputs.token_ids))

    def _shadow_due(self, req_id: str) -> bool:
        count = self._since_shadow.get(req_id, SHADOW_EVERY - 1) + 1  # a new request's first step is a round
        self._since_shadow[req_id] = 0 if count >= SHADOW_EVERY else count
        return count >= SHADOW_EVERY

    def _keep_shadows(self, inputs: DraftInputs, found: list[list[list[int] | None]], sources: list[int | None],
                      shadowing: list[bool]) -> None:
        """The drafts of lookups asked in a shadow round and not used wait to be scored."""
        for i, rid in enumerate(inputs.req_ids):
            if not shadowing[i]:
                continue
            for option in range(self.num_lookups):
                tokens = found[option][i]
                if tokens and sources[i] != option:
                    self._shadows.setdefault(rid, {}).setdefault(option, (len(inputs.token_ids[i]), tokens))

    def _score_shadows(self, inputs: DraftInputs) -> list[tuple[str, int, int, int]]:
        """(request, option, drafts, accepted) of each shadow draft whose fate the new tokens settle: a
        mismatch, or every draft matched."""
        scored = []
        for rid, history in zip(inputs.req_ids, inputs.token_ids):
            pending = self._shadows.get(rid)
            if not pending:
                continue
            for option, (start, tokens) in list(pending.items()):
                known = min(len(history) - start, len(tokens))
                matched = 0
                while matched < known and history[start + matched] == tokens[matched]:
                    matched += 1
                if matched < known or matched == len(tokens):
                    scored.append((rid, option, len(tokens), matched))
                    del pending[option]
        return scored

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
