"""Offline replay of the lookup drafters (ngram, suffix, auto's lookups) and the draft policy against real
greedy outputs: tokens per unit of step cost, per Spec-Bench category, without timing noise.

Greedy speculative decoding emits exactly plain decoding's tokens, so which drafts would be accepted can be
computed from plain outputs alone. This script generates plain greedy outputs once (cached in --outputs),
then replays each method one request at a time, in order, with specserve's own proposers and DraftPolicy:
every step the policy plans, the proposer drafts, the accepted prefix is checked against the real output,
and the step is charged cost(d) = 1 + c * d one-token steps for d verified drafts. Measure c on the machine
with `benchmarks/step_costs.py` (a 5-token step over a one-token step, minus 1, over 4; e.g. ~0.035 on fp32
weights on an Intel Xeon, ~0.18 on 4-bit GGUF blocks on an AMD EPYC). Plain decoding scores 1.0.

    .venv/bin/python benchmarks/spec_replay.py --prompts-per-category 6 --cost 0.18 --cost 0.035

It also prints a hindsight bound per method: every step drafts exactly the tokens that would be accepted
from the drafts the proposer offers at full length (never a rejected draft), at the same cost. A method
written METHOD+tree drafts trees (draft_tree "auto"): a step accepts the longest path of the tree that
matches the output and is charged cost(number of nodes), each tree sized by the same cost curve. With
--noise the policy is also fed each step's time as a shared host reports it (spread, and now and then a
slowed step), as the engine's live timings are, while the charged cost stays the given curve.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from pathlib import Path

from specserve.bench.common import DEFAULT_DATASET, read_specbench
from specserve.bench.latency import select_per_category
from specserve.config import SpeculativeConfig
from specserve.spec_decode.policy import DraftOption, DraftPolicy
from specserve.spec_decode.proposer import DraftInputs, make_proposer

METHODS = ("ngram", "suffix", "auto")
TREE = "+tree"
STEP_SECONDS = 0.0035  # a one-token step's time under --noise (only ratios matter)
SPIKE_RATE = 0.05  # under --noise, the share of steps slowed 1.3-2.5x by other work on the host
MAX_MODEL_LEN = 8192


def generate(dataset: str, per_category: int, max_tokens: int) -> list[dict]:
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

    chosen = select_per_category(read_specbench(dataset), None, per_category)
    llm = LLM(max_num_seqs=16)
    outs = llm.chat([[{"role": "user", "content": r["turns"][0]}] for r in chosen],
                    SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [{"category": r["category"], "prompt": list(o.prompt_token_ids), "output": list(o.outputs[0].token_ids)}
            for r, o in zip(chosen, outs)]


def accepted_prefix(tokens: list[int], pos: int, draft: list[int]) -> int:
    """How many leading tokens of `draft` equal tokens[pos:]."""
    n = 0
    while n < len(draft) and pos + n < len(tokens) and tokens[pos + n] == draft[n]:
        n += 1
    return n


def accepted_path(tokens: list[int], pos: int, tree) -> list[int]:
    """The nodes of `tree` (spec_decode/tree.py) that greedy verification accepts when the output goes on
    with tokens[pos:]."""
    path, node = [], -1
    while pos + len(path) < len(tokens):
        child = tree.children[node].get(tokens[pos + len(path)])
        if child is None:
            break
        path.append(child)
        node = child
    return path


class Replay:
    """One method's proposer and policy over a sequence of requests, as the runner drives them at batch 1."""

    def __init__(self, method: str, cost: list[float], oracle: bool = False, overrides: dict | None = None,
                 noise: float = 0.0, call_cost: float = 0.0) -> None:
        self.trees = method.endswith(TREE)
        method = method.removesuffix(TREE)
        config = SpeculativeConfig.from_dict({"method": method, **({"drafter": "none"} if method == "auto" else {}),
                                              **({"draft_tree": "auto"} if self.trees else {}), **(overrides or {})})
        self.proposer = make_proposer(config, None)
        options = self.proposer.needs.options or (DraftOption(method, config.num_speculative_tokens),)
        self.max_k = max(o.max_drafts for o in options)
        self.max_nodes = config.draft_tree_max_nodes if self.trees else 0
        self.curve = [1.0] + [cost[min(k, len(cost)) - 1] if len(cost) > 1 else 1.0 + cost[0] * k
                              for k in range(1, max(self.max_k, self.max_nodes) + 1)]
        self.policy = DraftPolicy(options)
        self.policy.seed_step_costs({1 + k: STEP_SECONDS * c for k, c in enumerate(self.curve)}, {})  # calibrated
        self.oracle = oracle
        self.finished: set[str] = set()
        self.noise = noise
        self.rng = random.Random(0)
        self.call_cost, self.calls = call_cost, 0
        for lookup in getattr(self.proposer, "proposers", [self.proposer]):  # count the calls that search
            lookup.propose = self._counted(lookup.propose)

    def _counted(self, propose):
        def counted(inputs: DraftInputs):
            self.calls += any(inputs.num_drafts)
            return propose(inputs)
        return counted

    def request(self, rid: str, prompt: list[int], output: list[int]) -> float:
        """Steps (in one-token step units) to emit `output` after the prefill's first token."""
        tokens, pos, steps = prompt + output, len(prompt) + 1, 0.0
        self.calls = 0
        while pos < len(tokens):
            room = len(tokens) - pos - 1  # drafts past the last token would never be verified
            plan = self.policy.plan(rid, min(self.max_k, room)) if not self.oracle else [
                (i, min(o.max_drafts, room)) for i, o in enumerate(self.policy.options)]
            draft, source, tree = [], 0, None
            if any(k for _, k in plan):
                draft, source, tree = self._propose(rid, tokens[:pos], len(prompt), plan)
            if tree is not None:
                path = accepted_path(tokens, pos, tree)
                accepted = len(path)
                if self.oracle:  # the accepted path alone, as a chain
                    draft = [tree.tokens[v] for v in path]
            else:
                accepted = accepted_prefix(tokens, pos, draft)
                if self.oracle:
                    draft = draft[:accepted]
            if draft:
                self.policy.record(rid, tree.depth if tree is not None and not self.oracle else len(draft),
                                   accepted, source)
            steps += self.curve[len(draft)]
            pos += accepted + 1
            if self.noise:  # the policy sees the step's time as a shared host would report it
                self.policy.observe_step(1, 1 + len(draft), STEP_SECONDS * self.curve[len(draft)] * self._jitter())
        self.policy.forget(rid)
        self.finished.add(rid)
        return steps + self.call_cost * self.calls

    def _jitter(self) -> float:
        """A shared host's factor on one step's time: log-normal spread, and now and then a preempted step."""
        factor = self.rng.lognormvariate(0.0, self.noise)
        return factor * self.rng.uniform(1.3, 2.5) if self.rng.random() < SPIKE_RATE else factor

    def _propose(self, rid: str, history: list[int], num_prompt: int, plan):
        """(drafts, the option that drafted them, their tree or None)."""
        inputs = DraftInputs(req_ids=[rid], sampled_token_ids=[history[-1:]], next_token_ids=[history[-1]],
                             token_ids=[history], num_prompt_tokens=[num_prompt], num_drafts=[plan[0][1]],
                             sampling_params=[None], seeds=[None], max_model_len=MAX_MODEL_LEN,
                             finished_req_ids=self.finished, draft_plans=[plan])
        if self.trees:
            inputs.tree_costs, inputs.max_tree_nodes = self.policy.draft_costs, self.max_nodes
        self.finished = set()
        out = self.proposer.propose(inputs)
        for shadow_rid, option, num_drafts, num_accepted in out.shadow_records or ():  # as the runner does
            self.policy.record(shadow_rid, num_drafts, num_accepted, option)
        tree = out.trees[0] if out.trees is not None else None
        return out.token_ids[0], (out.sources[0] or 0) if out.sources is not None else 0, tree


def score(items: list[dict], method: str, cost: list[float], oracle: bool = False,
          overrides: dict | None = None, noise: float = 0.0, call_cost: float = 0.0) -> dict[str, float]:
    """Per category, output tokens per unit of step cost over its requests (plain decoding: 1.0)."""
    replay, emitted, steps = Replay(method, cost, oracle, overrides, noise, call_cost), {}, {}
    for i, item in enumerate(items):
        c = item["category"]
        steps[c] = steps.get(c, 0.0) + replay.request(f"r{i}", item["prompt"], item["output"])
        emitted[c] = emitted.get(c, 0) + len(item["output"]) - 1
    return {c: emitted[c] / steps[c] for c in emitted}


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default=DEFAULT_DATASET)
    p.add_argument("--prompts-per-category", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--cost", action="append",
                   help="cost of one verified draft token, in one-token steps, or the measured cost of a step "
                        "verifying 1, 2, ... drafts over a one-token step, comma-separated (the last one "
                        "repeats); repeatable (default: 0.035)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--outputs", default="bench_results/spec_replay_outputs.json",
                   help="plain outputs, generated once and reused")
    p.add_argument("--bounds", action="store_true", help="also print the hindsight bound of each method")
    p.add_argument("--spec-config-json", default="{}",
                   help="per-method speculative_config overrides, e.g. "
                        "'{\"suffix\": {\"suffix_decoding_min_token_prob\": 0.2}}'")
    p.add_argument("--noise", type=float, default=0.0,
                   help="feed the policy each step's time as measured on a noisy host: log-normal spread with this "
                        "sigma (e.g. 0.1) and 5%% of steps slowed 1.3-2.5x; charged cost stays the true curve")
    p.add_argument("--call-cost", type=float, default=0.0,
                   help="cost of each lookup call that searches for drafts, in one-token steps (Python time in "
                        "the runner: ~0.006 for 30 us against a 5 ms step)")
    args = p.parse_args()
    overrides = json.loads(args.spec_config_json)
    path = Path(args.outputs)
    if path.is_file():
        items = json.loads(path.read_text())
    else:
        items = generate(args.dataset, args.prompts_per_category, args.max_tokens)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(items))
    categories = list(dict.fromkeys(i["category"] for i in items))
    print(f"tokens per unit of step cost ({len(items)} requests, one at a time; plain decoding = 1.00)")
    print(f"{'cost':>9} {'method':>12}  " + " ".join(f"{c[:8]:>8}" for c in categories) + "  geomean   min")
    for text in args.cost or ["0.035"]:
        cost = [float(v) for v in text.split(",")]
        for method in args.methods.split(","):
            for oracle in (False, True) if args.bounds else (False,):
                row = score(items, method, cost, oracle, overrides.get(method), args.noise, args.call_cost)
                values = [row[c] for c in categories]
                label = method + (" bound" if oracle else "")
                print(f"{text[:9]:>9} {label:>12}  " + " ".join(f"{v:8.2f}" for v in values)
                      + f"  {geomean(values):7.3f} {min(values):5.2f}")
    print(f"median output length {statistics.median(len(i['output']) for i in items)} tokens")


if __name__ == "__main__":
    main()
