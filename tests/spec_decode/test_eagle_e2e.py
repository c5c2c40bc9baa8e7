"""EAGLE and EAGLE-3 end to end: greedy output equals plain decoding, every draft equals a from-scratch
reference of the published forward pass, the target's [3, T] positions reach the drafter, sampled drafts
keep the target distribution, and a checkpoint that does not fit the target fails when the LLM is built.

Runs use mixed batches (prompts of 5 to 60 tokens arriving together), a 24-token budget that splits
prompts into chunks, and a KV pool small enough to preempt requests.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from specserve.llm import LLM
from specserve.models.loader import ModelLoadError
from specserve.ops.kernels import kernel_usable
from specserve.sampling_params import SamplingParams
from specserve.tokenizer import load_tokenizer
from tests.models.drafter_checkpoints import (WrittenDrafter, draft_vocabulary, rewrite_tensors, target_fields,
                                              write_eagle, write_eagle3)
from tests.models.test_eagle_heads import eagle3_target_ids, ref_cos_sin, ref_eagle1, ref_eagle3, ref_eagle3_logits
from tests.spec_decode.test_spec_sampling_e2e import VOCAB, check_first_tokens_follow_the_target
from tests.tiny_models import perturb_norms_and_biases, save_hf_folder, tiny_hf_model

K = 3  # drafts per step
ENGINE = dict(max_model_len=128, max_num_batched_tokens=24, block_size=8, max_num_seqs=4, kv_cache_memory_bytes=64 << 20)
TIGHT = dict(ENGINE, num_kv_blocks=16)  # 16 blocks of 8 tokens for four requests of up to 90: preemption
PARAMS = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
PROMPT_LENGTHS = (5, 30, 17, 60)

Layout = Callable[[torch.Tensor], torch.Tensor]  # [N] token indices -> [N] or [3, N] positions


def text_positions(index: torch.Tensor) -> torch.Tensor:
    return index


def mrope_text_positions(index: torch.Tensor) -> torch.Tensor:
    return index.expand(3, -1)


def distinct_rows(index: torch.Tensor) -> torch.Tensor:
    """[N] -> [3, N] rows that differ in their spacing (as an image's height and width rows do): a relative
    rotation that a drafter reading one row, or the wrong row, would get wrong."""
    return torch.stack([index, index // 2, index // 3])


def one_row(index: torch.Tensor) -> torch.Tensor:
    return distinct_rows(index)[0].expand(3, -1)


# ---------------------------------------------------------------- targets


def counting_llama(num_layers: int = 8):
    """A random Llama (8 layers by default) whose LM head is its embedding shifted by one id (row v = embed[v - 1]) and
    whose final norm weight is 1: without its layers it would count x -> x + 1; its layers make it jump
    elsewhere at about 40% of steps. A drafter that counts is right until the target jumps."""
    hf = tiny_hf_model("llama", num_hidden_layers=num_layers)
    with torch.no_grad():
        hf.lm_head.weight.copy_(hf.model.embed_tokens.weight.roll(1, 0))
        hf.model.norm.weight.fill_(1.0)
    return hf


def tiny_qwen2_vl_text(num_layers: int = 4):
    """A random Qwen2-VL (M-RoPE) with enough layers for three distinct EAGLE-3 aux layers."""
    import transformers

    from tests.models.test_qwen2_vl_parity import IDS, TEXT, VISION

    torch.manual_seed(1234)
    config = transformers.Qwen2VLConfig(text_config=dict(copy.deepcopy(TEXT), num_hidden_layers=num_layers),
                                        vision_config=copy.deepcopy(VISION["qwen2_vl"]), **IDS)
    config._attn_implementation = "eager"
    return perturb_norms_and_biases(transformers.Qwen2VLForConditionalGeneration(config).eval().float())


def save_qwen2_vl(hf, path) -> str:
    hf.save_pretrained(str(path))
    load_tokenizer(None).backend.save(str(path / "tokenizer.json"))  # outputs are compared as token ids
    return str(path)


def mixed_prompts(seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 150, (n,), generator=g).tolist()} for n in PROMPT_LENGTHS]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@dataclass
class Target:
    hf: object
    folder: str
    layout: Layout  # the positions the runner gives the target
    prompts: list[dict]
    plain: list[list[int]]  # plain greedy decoding's tokens

    def sequences(self) -> list[list[int]]:
        return [p["prompt_token_ids"] + out for p, out in zip(self.prompts, self.plain)]


def plain_target(hf, folder: str, layout: Layout, patch: Layout | None = None,
                 prompts: list[dict] | None = None) -> Target:
    prompts = prompts or mixed_prompts()
    plain = LLM(model=folder, **ENGINE)
    if patch is not None:
        plain.llm_engine.runner.layout_positions = patch
    return Target(hf, folder, layout, prompts, token_ids(plain.generate(prompts, PARAMS, use_tqdm=False)))


# ---------------------------------------------------------------- drafters that draft well


def counting_eagle(folder: str, hf) -> WrittenDrafter:
    """EAGLE-1 whose output is the embedding of its input token: fc = [I | 0], attention and MLP outputs
    zeroed, so g = embed(x_{p+1}) and the target's LM head drafts x_{p+1} + 1, + 2, ... (counting on)."""
    H = hf.config.hidden_size
    written = write_eagle(folder, hf.config, fc_bias=False)
    return rewrite_tensors(written, {"fc.weight": torch.cat([torch.eye(H), torch.zeros(H, H)], 1),
                                     "layers.0.self_attn.o_proj.weight": torch.zeros(H, H),
                                     "layers.0.mlp.down_proj.weight": torch.zeros_like(
                                         written.layer("mlp.down_proj.weight"))})


def counting_eagle3(folder: str, hf, draft_vocab_size: int = 120) -> WrittenDrafter:
    """EAGLE-3 reading the embedding (the input of layer 0) through fc = [I, 0, 0], with attention and MLP
    outputs zeroed and lm_head row d = embed[target id of d - 2]: its first draft from row p is x_p + 2,
    the counting target's x_{p+2}; later drafts repeat it (g does not change), so they are mostly rejected."""
    H = hf.config.hidden_size
    written = write_eagle3(folder, hf.config, draft_vocab_size=draft_vocab_size, aux_layer_ids=[0, 3, 6])
    ids = draft_vocabulary(hf.config.vocab_size, draft_vocab_size)
    embed = hf.model.embed_tokens.weight.detach()
    return rewrite_tensors(written, {"fc.weight": torch.cat([torch.eye(H), torch.zeros(H, 2 * H)], 1),
                                     "midlayer.self_attn.o_proj.weight": torch.zeros(H, H),
                                     "midlayer.mlp.down_proj.weight": torch.zeros_like(
                                         written.layer("mlp.down_proj.weight")),
                                     "norm.weight": torch.ones(H),
                                     "lm_head.weight": embed[(ids - 2) % hf.config.vocab_size].clone()})


# ---------------------------------------------------------------- capturing what the drafter did


@dataclass
class DraftStep:
    """One propose() call: per request of the step, what the drafter was given and what it drafted."""

    req_ids: list[str]
    histories: list[list[int]]
    num_drafts: list[int]
    drafts: list[list[int]] = field(default_factory=list)
    # the head's output g [H] that each draft was drawn from (EAGLE under greedy requests)
    outputs: list[list[torch.Tensor]] = field(default_factory=list)
    # (drafts verified, drafts accepted) of the request's previous drafts, None when it had none
    verified: list[tuple[int, int] | None] = field(default_factory=list)
    num_partial_chunks: int = 0  # requests whose rows were a partial prompt chunk


def capture_drafts(llm: LLM, transform: Callable | None = None) -> list[DraftStep]:
    """Record every propose() call of llm's proposer; transform(inputs) may alter the inputs first.

    For an EAGLE head, each greedy draw's g is kept too: draw j of a call covers the requests still drafting
    (num_drafts > j), in batch order. The head drafts a step at a time for that (its one-call C chains give the
    same drafts bitwise: tests/models/test_eagle_heads.py)."""
    proposer = llm.llm_engine.runner.proposer
    propose, steps, pending, draws = proposer.propose, [], {}, []
    head = getattr(proposer, "head", None)
    if head is not None:
        head.chains_kernel = lambda kv_cache: None
        greedy_tokens = head.greedy_tokens
        head.greedy_tokens = lambda g: (draws.append(g.clone()), greedy_tokens(g))[1]

    def recorded(inputs):
        step = DraftStep(list(inputs.req_ids), [list(t) for t in inputs.token_ids], list(inputs.num_drafts))
        step.num_partial_chunks = len(set(inputs.target_req_ids) - set(inputs.req_ids))
        for rid, sampled in zip(inputs.req_ids, inputs.sampled_token_ids):
            previous = pending.pop(rid, None)
            step.verified.append(None if previous is None else (previous, len(sampled) - 1))
        if transform is not None:
            transform(inputs)
        draws.clear()
        drafts = propose(inputs)
        step.drafts = [list(d) for d in drafts.token_ids]
        step.outputs = [[] for _ in step.req_ids]
        for j, g in enumerate(draws):
            live = [i for i, n in enumerate(step.num_drafts) if n > j]
            assert len(live) == len(g)
            for i, row in zip(live, g):
                step.outputs[i].append(row)
        pending.update((rid, len(d)) for rid, d in zip(step.req_ids, step.drafts) if d)
        steps.append(step)
        return drafts

    proposer.propose = recorded
    return steps


def after_rejections(steps: list[DraftStep]) -> int:
    """Drafting calls that followed a verification rejecting some or all of a request's drafts (or a
    preemption dropping them): the drafter's slots from those drafts must have been rewritten."""
    return sum(1 for s in steps for v, n in zip(s.verified, s.num_drafts) if n and v and v[1] < v[0])


def partial_acceptances(steps: list[DraftStep]) -> int:
    """Drafting calls that followed a verification accepting some of a request's drafts and rejecting the rest
    (a preempted request's dropped drafts count as rejected, never as partially accepted)."""
    return sum(1 for s in steps for v, n in zip(s.verified, s.num_drafts) if n and v and 0 < v[1] < v[0])


def collapse_to_one_row(inputs) -> None:
    inputs.target_positions = inputs.target_positions[0].expand(3, -1)
    inputs.next_positions = inputs.next_positions[0].expand(3, -1)


# ---------------------------------------------------------------- the reference


def hf_states(hf, tokens: list[int], positions: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """transformers' final post-norm states [N, H] and hidden_states (entry i: the input of layer i)."""
    kwargs = {"position_ids": positions[:, None, :]} if positions.dim() == 2 else {}
    with torch.no_grad():
        out = hf.model(input_ids=torch.tensor([tokens]), output_hidden_states=True, **kwargs)
    return out.last_hidden_state[0], [h[0] for h in out.hidden_states]


class EagleReference:
    """EAGLE-1/3 drafts recomputed from scratch for one history x_0..x_{n-1}: full causal attention over slots
    p = 0..n-2 holding (f_p, x_{p+1}) at the target's positions of p, the last slot's output g gives draft 1,
    and each further draft appends the slot (g, the draft just made) at the next input's position + step.

    f_p: EAGLE-1, transformers' final post-norm state of token p; EAGLE-3, fc over hidden_states[i] for the
    aux layers i, in the checkpoint's order. Drafts come from the target's LM head (EAGLE-1), or from the
    head's lm_head over its own vocabulary mapped to target ids by d2t (EAGLE-3)."""

    def __init__(self, hf, written: WrittenDrafter, sequences: list[list[int]], target_layout: Layout,
                 drafter_layout: Layout) -> None:
        self.written, self.layout = written, drafter_layout
        self.t = {**target_fields(hf.config), "hidden_size": written.tensor("fc.weight").shape[0]}
        self.section = self.t.get("mrope_section")  # M-RoPE frequencies per t/h/w row, None for RoPE
        target_embed = hf.get_input_embeddings().weight.detach()
        self.embed = written.tensors.get(written.prefix + "embed_tokens.weight", target_embed)
        self.lm_head = hf.get_output_embeddings().weight.detach()
        self.features: dict[tuple[int, ...], torch.Tensor] = {}  # full sequence -> f_p of all its tokens
        for seq in sequences:
            final, hidden = hf_states(hf, seq, target_layout(torch.arange(len(seq))))
            if written.family == "eagle":
                self.features[tuple(seq)] = final
            else:
                aux = torch.cat([hidden[i] for i in eagle3_aux_layers(written, len(hidden) - 1)], -1)
                self.features[tuple(seq)] = F.linear(aux, written.tensor("fc.weight"), written.tensors.get("fc.bias"))

    def _features_of(self, history: list[int]) -> torch.Tensor:
        (f,) = [f for seq, f in self.features.items() if list(seq[: len(history)]) == history]
        return f[: len(history) - 1]

    def drafts(self, history: list[int], k: int) -> tuple[list[int], list[torch.Tensor]]:
        """k drafts after `history`, and the head's output g [H] each was drawn from."""
        n, w, t = len(history), self.written, self.t
        tokens, features = list(history[1:]), self._features_of(history)
        positions, next_position = self.layout(torch.arange(n - 1)), self.layout(torch.tensor([n - 1]))
        drafts, outputs = [], []
        for step in range(k):
            cos, sin = ref_cos_sin(positions, t["head_dim"], t["rope_theta"], self.section)
            if w.family == "eagle":
                g = ref_eagle1(w, t, self.embed, torch.tensor(tokens), features, cos, sin)[-1:]
                draft = int((g @ self.lm_head.t()).argmax())
            else:
                nbr = w.config.get("norm_before_residual", w.config.get("speculators_model_type") == "eagle3")
                g = ref_eagle3(w, t, self.embed, torch.tensor(tokens), features, cos, sin, nbr)[-1:]
                draft = int(eagle3_target_ids(w, ref_eagle3_logits(w, t, g).argmax(-1))[0])
            drafts.append(draft)
            outputs.append(g[0])
            tokens.append(draft)
            features = torch.cat([features, g])
            positions = torch.cat([positions, next_position + step], -1)
        return drafts, outputs


def eagle3_aux_layers(written: WrittenDrafter, num_layers: int) -> list[int]:
    """The ids the checkpoint names (official: eagle_config; speculators: top level), else (2, L // 2, L - 3)."""
    config = written.config
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = ids or config.get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if ids else [2, num_layers // 2, num_layers - 3]


# The head's outputs against the reference: float32 both, different summation orders (errors ~1e-6); a
# drafter slot holding the wrong token or feature moves g by 1e-3 or more.
G_TOL = 1e-4


def assert_drafts_match(steps: list[DraftStep], reference: EagleReference) -> int:
    """Every request's drafts of every step, and the outputs g they were drawn from, equal the reference;
    returns how many draft lists were compared."""
    compared = 0
    for number, step in enumerate(steps):
        for i, (rid, history, n) in enumerate(zip(step.req_ids, step.histories, step.num_drafts)):
            if n == 0:
                continue
            where = f"step {number}, request {rid}, {len(history)} tokens"
            drafts, outputs = reference.drafts(history, n)
            assert step.drafts[i] == drafts, where
            error = (torch.stack(step.outputs[i]) - torch.stack(outputs)).abs().max().item()
            assert error < G_TOL, f"{where}: g differs by {error:.2g}"
            compared += 1
    return compared


# ---------------------------------------------------------------- the runs


def llama_target(tmp_path_factory) -> Target:
    hf = counting_llama()
    return plain_target(hf, save_hf_folder(hf, tmp_path_factory.mktemp("counting_llama")), text_positions)


def qwen_target(tmp_path_factory) -> Target:
    hf = tiny_qwen2_vl_text()
    return plain_target(hf, save_qwen2_vl(hf, tmp_path_factory.mktemp("qwen2_vl")), mrope_text_positions)


@dataclass
class Run:
    target: Target
    written: WrittenDrafter
    outputs: list[list[int]]
    metrics: object
    steps: list[DraftStep]
    num_partial_prefills: int


def write_drafter(case: str, folder: str, hf) -> WrittenDrafter:
    if case == "eagle":
        return write_eagle(folder, hf.config)
    if case == "eagle-counting":
        return counting_eagle(folder, hf)
    if case == "eagle3-counting":
        return counting_eagle3(folder, hf)
    if case == "mrope-eagle":
        return write_eagle(folder, hf.config, qkv_bias=True)  # a Qwen2-style layer: q/k/v biases
    if case == "mrope-eagle3":
        return write_eagle3(folder, hf.config, draft_vocab_size=64, aux_layer_ids=[1, 3, 2])
    return write_eagle3(folder, hf.config, layout=case.split("-")[1], draft_vocab_size=64)  # eagle3-<layout>


@dataclass
class DraftRun:
    llm: LLM
    outputs: list[list[int]]
    steps: list[DraftStep]
    num_partial_prefills: int  # prompt chunks scheduled short of the prompt's end


def run_drafter(target: Target, written: WrittenDrafter, patch: Layout | None = None,
                transform: Callable | None = None, setup: Callable | None = None, **engine) -> DraftRun:
    """target's prompts through an LLM drafting with `written` (TIGHT, updated by `engine`); `patch` replaces
    the runner's position layout, `transform` alters each DraftInputs before the proposer sees it, `setup`
    may change the LLM before it runs."""
    llm = LLM(model=target.folder, speculative_config={"method": written.family, "model": written.folder,
                                                       "num_speculative_tokens": K, "adaptive_draft_length": False},
              **{**TIGHT, **engine})
    runner = llm.llm_engine.runner
    if patch is not None:
        runner.layout_positions = patch
    if setup is not None:
        setup(llm)
    steps, execute, chunks = capture_drafts(llm, transform), runner.execute_model, []

    def counted(sched):
        chunks.extend(1 for r in sched.scheduled_new_reqs
                      if sched.num_scheduled_tokens[r.req_id] < len(r.prompt_token_ids) - r.num_computed_tokens)
        return execute(sched)

    runner.execute_model = counted
    outputs = token_ids(llm.generate(target.prompts, PARAMS, use_tqdm=False))
    return DraftRun(llm, outputs, steps, len(chunks))


# Random heads (eagle, eagle3-<layout>, mrope-*) are rarely right: their runs reject nearly every draft.
# The counting drafters are right until the counting target jumps: accepted in full, in part, or not.
CASES = ["eagle", "eagle3-official", "eagle3-sglang", "eagle3-speculators", "eagle-counting", "eagle3-counting",
         "mrope-eagle", "mrope-eagle3"]
COUNTING = ["eagle-counting", "eagle3-counting"]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> Callable[[str], Run]:
    """case -> its run, made once per module (each test below reads the same runs)."""
    done: dict[str, Run] = {}

    def get(case: str) -> Run:
        if case not in done:
            target = request.getfixturevalue("qwen" if case.startswith("mrope") else "llama")
            written = write_drafter(case, str(tmp_path_factory.mktemp(case)), target.hf)
            result = run_drafter(target, written)
            done[case] = Run(target, written, result.outputs, result.llm.get_metrics(), result.steps,
                             result.num_partial_prefills)
        return done[case]

    return get


# ---------------------------------------------------------------- 1. greedy output


@pytest.mark.parametrize("case", ["eagle3-counting", "eagle3-official"])
def test_c_chains_accept_what_the_step_by_step_drafts_accept(case, runs):
    """The engine drafting greedy chains in one C call (not captured, so the head's chains kernel runs):
    output equals plain decoding, and with preemption and chunked prefill the same drafts are accepted at
    every position as in the step-by-step run."""
    run = runs(case)
    llm = LLM(model=run.target.folder, speculative_config={"method": "eagle3", "model": run.written.folder,
                                                           "num_speculative_tokens": K, "adaptive_draft_length": False},
              **TIGHT)
    head, calls = llm.llm_engine.runner.proposer.head, []
    chains = head.draft_chains
    head.draft_chains = lambda *args: (calls.append(len(args[2])), chains(*args))[1]
    assert token_ids(llm.generate(run.target.prompts, PARAMS, use_tqdm=False)) == run.target.plain
    if kernel_usable(torch.float32):
        assert sum(calls) > 20 and max(calls) > 1
    m = llm.get_metrics()
    assert (m.num_drafts, m.accepted_per_position) == (run.metrics.num_drafts, run.metrics.accepted_per_position)


@pytest.mark.parametrize("case", CASES)
def test_greedy_output_equals_plain_decoding(case, runs):
    run = runs(case)
    assert run.outputs == run.target.plain
    m = run.metrics
    assert m.num_preemptions > 0
    assert run.num_partial_prefills > 0  # prompts were split into chunks
    assert sum(s.num_partial_chunks for s in run.steps) > 0  # and the drafter wrote its KV for each chunk
    assert m.num_draft_tokens > 0 and m.num_accepted_tokens < m.num_draft_tokens


@pytest.mark.parametrize("case", COUNTING)
def test_a_drafter_that_drafts_well_is_accepted_and_rejected(case, runs):
    """Acceptance paths: drafts accepted in part (the rejected tail's slots in the drafter's KV rewritten by
    the next step) and, for the EAGLE-1 that counts on, in full with the bonus token."""
    run = runs(case)
    m = run.metrics
    assert m.accepted_per_position[0] > 0.2 * m.num_drafts  # the first draft is right at least a fifth of steps
    assert m.num_accepted_tokens < m.num_draft_tokens
    assert partial_acceptances(run.steps) > 0
    if case == "eagle-counting":
        assert m.accepted_per_position[K - 1] > 0  # all K accepted: the bonus token follows


# ---------------------------------------------------------------- 2. drafts against the reference


@pytest.mark.parametrize("case", CASES)
def test_drafts_equal_the_reference_forward_pass(case, runs):
    """Each drafting call, per request, equals the reference from scratch: the drafter's KV after chunked
    prefill, preemption and rejected drafts holds exactly the target-verified slots; EAGLE-3 reads the aux
    layers' inputs and maps its smaller vocabulary through d2t."""
    run = runs(case)
    target = run.target
    reference = EagleReference(target.hf, run.written, target.sequences(), target.layout, target.layout)
    assert assert_drafts_match(run.steps, reference) > 20
    assert after_rejections(run.steps) > 10
    if run.written.family == "eagle3":
        assert run.written.tensor("d2t").any()  # a draft vocabulary smaller than the target's, remapped
    if case in COUNTING:
        assert partial_acceptances(run.steps) > 0  # steps right after a partial rejection were compared


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_requests_sharing_a_prompt_prefix_draft_as_the_reference(prefix_caching, llama, tmp_path):
    """Three prompts share their first two blocks (16 tokens) and differ after them."""
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 150, (16,), generator=g).tolist()
    prompts = [{"prompt_token_ids": shared + torch.randint(3, 150, (n,), generator=g).tolist()} for n in (14, 9, 20)]
    target = plain_target(llama.hf, llama.folder, text_positions, prompts=prompts)
    written = write_drafter("eagle", str(tmp_path), llama.hf)
    result = run_drafter(target, written, enable_prefix_caching=prefix_caching, num_kv_blocks=64)
    assert result.outputs == target.plain
    assert (result.llm.get_metrics().prefix_cache_hits > 0) == prefix_caching
    reference = EagleReference(llama.hf, written, target.sequences(), text_positions, text_positions)
    assert assert_drafts_match(result.steps, reference) > 20


@pytest.mark.parametrize("case", ["eagle-counting", "eagle3-official"])
def test_a_request_that_skips_drafting_resumes_as_the_reference(case, llama, tmp_path):
    """Drafting off for two steps in three, per request (as the pricing does when a draft would not pay):
    the head runs no forward for those steps' decode rows, keeps them aside and writes them with the next
    drafting step's rows, and every draft after resuming equals the from-scratch reference."""
    written = write_drafter(case, str(tmp_path), llama.hf)
    counts: dict[str, int] = {}

    def every_third_step(req_id, max_k):
        counts[req_id] = counts.get(req_id, 0) + 1
        return [(0, min(K, max_k))] if counts[req_id] % 3 == 0 and max_k > 0 else []

    forwards = []

    def patch(llm):
        llm.llm_engine.runner.draft_policy.plan = every_third_step
        head = llm.llm_engine.runner.proposer.head
        forward = head.forward
        head.forward = lambda *a, **k: (forwards.append(len(a[0])), forward(*a, **k))[1]

    result = run_drafter(llama, written, setup=patch)
    assert result.outputs == llama.plain
    idle = [s for s in result.steps if not any(s.num_drafts) and not s.num_partial_chunks]
    assert len(idle) > 10  # steps in which no request drafted and no prompt was prefilled...
    assert max(forwards) > 1  # ...and a resuming request wrote its kept rows with the new ones in one pass
    reference = EagleReference(llama.hf, written, llama.sequences(), text_positions, text_positions)
    assert assert_drafts_match(result.steps, reference) > 10


@pytest.mark.parametrize("case", ["eagle", "eagle3-official"])
def test_a_prefix_hit_on_blocks_the_drafter_never_wrote_drafts_as_the_reference(case, llama, tmp_path):
    """A first request that never drafts (num_speculative_tokens=0: the head keeps its decode rows aside and
    drops them when it ends), then a second whose prompt is the first's prompt and answer plus more (a chat's
    next turn): its prefix hit covers blocks whose head KV was never written. The hit stops where the head's
    KV does, the target recomputes the rest, and every draft equals the from-scratch reference."""
    written = write_drafter(case, str(tmp_path), llama.hf)
    llm = LLM(model=llama.folder, speculative_config={"method": written.family, "model": written.folder,
                                                      "num_speculative_tokens": K, "adaptive_draft_length": False},
              **dict(ENGINE, num_kv_blocks=64))
    first = {"prompt_token_ids": torch.randint(3, 150, (21,), generator=torch.Generator().manual_seed(4)).tolist()}
    answer = token_ids(llm.generate([first], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                            num_speculative_tokens=0), use_tqdm=False))[0]
    second = {"prompt_token_ids": first["prompt_token_ids"] + answer + [7, 8, 9]}
    target = plain_target(llama.hf, llama.folder, text_positions, prompts=[second])
    steps = capture_drafts(llm)
    assert token_ids(llm.generate([second], PARAMS, use_tqdm=False)) == target.plain
    metrics = llm.get_metrics()
    assert 0 < metrics.prefix_cache_hits < len(first["prompt_token_ids"]) + len(answer)  # the answer's blocks: no
    reference = EagleReference(llama.hf, written, target.sequences(), text_positions, text_positions)
    assert assert_drafts_match(steps, reference) > 5


# ---------------------------------------------------------------- 3. M-RoPE positions reach the drafter


@pytest.mark.parametrize("case", ["mrope-eagle", "mrope-eagle3"])
def test_the_drafter_uses_the_targets_mrope_positions(case, qwen, tmp_path):
    """The runner's positions patched to three distinct rows, for the target and the drafter alike: output
    stays plain decoding's (with the same patch), drafts equal the reference at the [3, T] positions; fed
    row 0 in all three rows instead, the drafter drafts differently (and equals the reference at those)."""
    target = plain_target(qwen.hf, qwen.folder, distinct_rows, patch=distinct_rows)
    assert target.plain != qwen.plain  # the rows reach the target: its own output moves
    written = write_drafter(case, str(tmp_path), qwen.hf)
    drafts = {}
    for drafter_layout, transform in ((distinct_rows, None), (one_row, collapse_to_one_row)):
        result = run_drafter(target, written, patch=distinct_rows, transform=transform)
        assert result.outputs == target.plain
        reference = EagleReference(target.hf, written, target.sequences(), distinct_rows, drafter_layout)
        assert assert_drafts_match(result.steps, reference) > 20
        drafts[drafter_layout] = {(rid, len(h)): (d, torch.stack(g)) for s in result.steps
                                  for rid, h, d, g in zip(s.req_ids, s.histories, s.drafts, s.outputs) if d}
    common = drafts[distinct_rows].keys() & drafts[one_row].keys()  # same request, same history length
    assert len(common) > 20
    moved = [(drafts[distinct_rows][key][1] - drafts[one_row][key][1]).abs().max().item() for key in common]
    assert min(moved) > 1e-2  # every draft step reads the rows
    assert any(drafts[distinct_rows][key][0] != drafts[one_row][key][0] for key in common)


# ---------------------------------------------------------------- 4. sampled drafts


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    """A 16-token target (wide init: distributions far from uniform) and a random EAGLE-1 head: about one
    draft in five is accepted, so acceptances, rejections and recovered tokens all occur."""
    hf = tiny_hf_model("llama", seed=1, vocab_size=VOCAB, initializer_range=0.2)
    folder = tmp_path_factory.mktemp("tiny_vocab")
    return hf, save_hf_folder(hf, folder / "target"), write_eagle(str(folder / "eagle"), hf.config).folder


@pytest.mark.parametrize("sampling,seeded", [
    (dict(temperature=1.0), False),
    (dict(temperature=0.8, top_k=10, top_p=0.9), True),
], ids=["temperature", "top_k_top_p_seeded"])
def test_sampled_eagle_drafts_keep_the_target_distribution(tiny_vocab, sampling, seeded):
    """The head samples its drafts from its own q (shaped by the request's temperature, top-k, top-p), and
    verification keeps the target's distribution (check_first_tokens_follow_the_target: a chi-square test
    with a stated false-alarm rate, which also rejects a 25% hotter target)."""
    hf, target, eagle = tiny_vocab
    m = check_first_tokens_follow_the_target(hf, target, {"method": "eagle", "model": eagle,
                                                          "num_speculative_tokens": K}, sampling, seeded)
    assert 0 < m.num_accepted_tokens < 0.8 * m.num_draft_tokens


# ---------------------------------------------------------------- 5. checkpoints that do not fit


def _other_target(hf, **changes) -> dict:
    return {**target_fields(hf.config), **changes}


BAD_CHECKPOINTS = {
    "eagle-hidden-size": (lambda folder, hf: write_eagle(folder, _other_target(hf, hidden_size=32)),
                          r"tensor 'fc.weight' has shape \[32, 64\], expected \[64, 128\]"),
    "eagle3-hidden-size": (lambda folder, hf: write_eagle3(folder, _other_target(hf, hidden_size=32),
                                                           aux_layer_ids=[1, 2, 3]),
                           r"tensor 'fc.weight' has shape \[32, 96\], expected \[32, 192\]"),
    "eagle-vocabulary": (lambda folder, hf: write_eagle(folder, hf.config, embed_tokens=torch.zeros(200, 64)),
                         r"tensor 'embed_tokens.weight' has shape \[200, 64\], expected \[160, 64\]"),
    "eagle3-vocabulary": (lambda folder, hf: write_eagle3(folder, _other_target(hf, vocab_size=320),
                                                          draft_vocab_size=160),
                          r"tensor 'd2t' maps draft ids to target ids in \[\d+, \d+\], outside the target's "
                          r"vocabulary of 160 tokens"),
    "eagle-no-fc": (lambda folder, hf: rewrite_tensors(write_eagle(folder, hf.config),
                                                       {"fc.weight": None, "fc.bias": None}),
                    r"missing tensor 'fc.weight' \(EAGLE: \[H, 2H\]"),
    "eagle3-no-fc": (lambda folder, hf: rewrite_tensors(write_eagle3(folder, hf.config, layout="speculators"),
                                                        {"fc.weight": None}),
                     r"missing tensor 'fc.weight' \(\[H, 3 \* target hidden\]\)"),
}


def assert_refused_at_build(target: Target, folder: str, write: Callable, message: str) -> None:
    """A checkpoint written by write(folder, target.hf) makes LLM(...) raise, naming what does not fit."""
    written = write(folder, target.hf)
    with pytest.raises(ModelLoadError, match=message):
        LLM(model=target.folder, speculative_config={"method": written.family, "model": written.folder,
                                                     "num_speculative_tokens": K}, **TIGHT)


@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_a_checkpoint_that_does_not_fit_fails_when_the_llm_is_built(case, llama, tmp_path):
    assert_refused_at_build(llama, str(tmp_path), *BAD_CHECKPOINTS[case])
