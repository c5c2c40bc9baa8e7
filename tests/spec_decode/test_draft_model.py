"""Draft-model configuration errors are caught at start, with a message saying what is wrong."""
import pytest
import torch

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from tests.kernel_support import requires_c_kernels
from tests.tiny_models import tiny_hf_model


def record_drafts(runner) -> list[tuple[list[int], list[int]]]:
    """(history, drafts) of every request that drafts from now on, as the runner proposes them."""
    drafts_made, capture = [], runner.propose_draft_token_ids

    def recorded(batch, sampled, hidden, aux):
        out = capture(batch, sampled, hidden, aux)
        for rid in batch.sample_req_ids:
            if out and out.get(rid):
                drafts_made.append((list(runner.requests[rid].token_ids), out[rid]))
        return out

    runner.propose_draft_token_ids = recorded
    return drafts_made


def assert_greedy_continuations(draft_hf, drafts_made) -> None:
    """Each list of drafts is the draft model's greedy continuation of its history, computed from scratch by
    transformers."""
    for history, drafts in drafts_made:
        expected = list(history)
        with torch.no_grad():
            for _ in drafts:
                expected.append(int(draft_hf(torch.tensor([expected])).logits[0, -1].argmax()))
        assert drafts == expected[len(history):], f"{len(history)} tokens"


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    tiny_hf_model("llama").save_pretrained(str(tmp_path))  # vocabulary of 160, the target's is 49152
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(max_model_len=256, speculative_config={"method": "draft_model", "model": str(tmp_path)})


def test_a_missing_draft_model_path_is_refused():
    with pytest.raises((ValueError, FileNotFoundError), match="nowhere"):
        LLM(max_model_len=256, speculative_config={"method": "draft_model", "model": "/nowhere/draft"})


def test_drafting_time_is_measured_on_decode_steps_only(default_gguf_path):
    """The step that finishes a prompt has the drafter catch up on the whole prompt, a one-off cost
    per request that must not be priced into every later draft token."""
    llm = LLM(max_model_len=256, speculative_config={
        "method": "draft_model", "model": default_gguf_path, "num_speculative_tokens": 2,
        "adaptive_draft_length": False})
    runner = llm.llm_engine.runner
    seen = []
    observe = runner.draft_policy.observe_drafting
    runner.draft_policy.observe_drafting = lambda n, s, option=0: (seen.append(n), observe(n, s, option))
    calls = []
    propose = runner.proposer.propose
    runner.proposer.propose = lambda inputs: (calls.append(len(inputs.token_ids[0])), propose(inputs))[1]
    out = llm.generate([{"prompt_token_ids": list(range(1, 60))}],
                       SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    assert out.metrics.num_drafts > 1 and calls[0] == 60  # the first call came right after the prefill
    # every drafting call but the one right after the prefill, each with the 2 drafts it made
    assert len(seen) == len(calls) - 1 and set(seen) == {2}


@requires_c_kernels
def test_a_self_draft_works_in_the_targets_kv_cache(default_gguf_path):
    """The target's own weights in int8: the drafter reads the target's KV of the history and feeds only
    the newest token, so it never prefills the prompt itself; it keeps no KV pool of its own (the engine's
    KV budget holds as many blocks as without speculation), and its draft tokens' KV, written past the
    history, is overwritten by verification: greedy output stays plain decoding's."""
    spec = {"method": "draft_model", "model": default_gguf_path, "quantization": "int8",
            "num_speculative_tokens": 3, "adaptive_draft_length": False}
    llm = LLM(max_model_len=512, block_size=16, kv_cache_memory_bytes=64 << 20, speculative_config=spec)
    drafter, runner = llm.llm_engine.runner.proposer, llm.llm_engine.runner
    plain = LLM(max_model_len=512, block_size=16, kv_cache_memory_bytes=64 << 20)
    assert drafter.shares_target_kv and runner.drafter_kv is None
    assert llm.llm_engine.kv_cache_manager.num_blocks == plain.llm_engine.kv_cache_manager.num_blocks
    fed = []
    forward = drafter.model.forward
    drafter.model.forward = lambda ids, *a: (fed.append(len(ids)), forward(ids, *a))[1]
    prompt = {"prompt_token_ids": list(range(100, 180))}
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert max(fed) == 1  # one token per forward: the prompt was never fed to the drafter
    assert out.metrics.num_drafts > 3 and out.metrics.mean_acceptance_length > 2
    assert out.outputs[0].token_ids == plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def test_a_draft_model_that_skips_steps_catches_up_and_drafts_as_from_scratch(tmp_path):
    """A draft model with its own KV, drafting one step in three (as the pricing does when drafts do not
    pay): nothing runs in the steps between, and when it drafts again it feeds the tokens it missed in one
    forward, so every draft equals the draft model's greedy continuation of the whole history computed
    from scratch by transformers."""
    from tests.tiny_models import save_hf_folder

    target = save_hf_folder(tiny_hf_model("llama", seed=1), tmp_path / "target")
    draft_hf = tiny_hf_model("llama", seed=2, num_hidden_layers=1)
    draft = save_hf_folder(draft_hf, tmp_path / "draft")
    engine = dict(max_model_len=128, block_size=8, max_num_batched_tokens=32)
    llm = LLM(model=target, speculative_config={"method": "draft_model", "model": draft,
                                                "num_speculative_tokens": 3}, **engine)
    runner = llm.llm_engine.runner
    counts: dict[str, int] = {}

    def every_third_step(req_id, max_k):
        counts[req_id] = counts.get(req_id, 0) + 1
        return [(0, min(3, max_k))] if counts[req_id] % 3 == 0 and max_k > 0 else []

    runner.draft_policy.plan = every_third_step
    calls, behind, seen = [], [], set()
    propose = runner.proposer.propose

    def counted(inputs):  # how far each request that drafted before is behind when it drafts again
        calls.append(inputs)
        for rid, history, n in zip(inputs.req_ids, inputs.token_ids, inputs.num_drafts):
            if n and rid in seen:
                behind.append(len(history) - inputs.drafter_kv.num_valid[rid])
            if n:
                seen.add(rid)
        return propose(inputs)

    runner.proposer.propose = counted
    drafts_made = record_drafts(runner)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 150, (n,), generator=g).tolist()} for n in (7, 20, 13)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    plain = LLM(model=target, **engine).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert all(any(c.num_drafts) for c in calls)  # the proposer was called only when a request drafted
    assert behind and min(behind) >= 3  # two skipped steps' tokens and this one's, fed in one catch-up
    assert len(drafts_made) > 8
    assert_greedy_continuations(draft_hf, drafts_made)


def test_a_prefix_hit_on_blocks_the_draft_model_never_wrote_drafts_as_from_scratch(tmp_path):
    """A first request that never drafts (num_speculative_tokens=0) leaves its blocks without the draft model's
    KV; a second whose prompt is the first's prompt and answer plus more hits those blocks. The draft model
    counts as its own only the hit blocks it wrote (none here) and catches up on the rest: every draft equals
    its greedy continuation of the whole history computed from scratch by transformers."""
    from tests.tiny_models import save_hf_folder

    target = save_hf_folder(tiny_hf_model("llama", seed=1), tmp_path / "target")
    draft_hf = tiny_hf_model("llama", seed=2, num_hidden_layers=1)
    draft = save_hf_folder(draft_hf, tmp_path / "draft")
    llm = LLM(model=target, speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
                                                "adaptive_draft_length": False},
              max_model_len=128, block_size=8, max_num_batched_tokens=32)
    runner = llm.llm_engine.runner
    first = torch.randint(3, 150, (21,), generator=torch.Generator().manual_seed(0)).tolist()
    quiet = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, num_speculative_tokens=0)
    answer = llm.generate([{"prompt_token_ids": first}], quiet, use_tqdm=False)[0].outputs[0].token_ids
    drafts_made = record_drafts(runner)
    second = {"prompt_token_ids": first + answer + [5, 6, 7]}
    out = llm.generate([second], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    assert out.num_cached_tokens >= 40  # the hit reached into the first request's answer
    assert len(drafts_made) > 3
    assert_greedy_continuations(draft_hf, drafts_made)


@requires_c_kernels
@pytest.mark.parametrize("dequantize", [False, True], ids=["q4_1-blocks", "fp32"])
def test_a_draft_that_reads_more_bytes_than_the_target_is_not_tried(default_gguf_path, dequantize):
    """Before its time is measured, a draft token is priced at the draft's weight bytes over the target's:
    the int8 self-draft reads ~a quarter of an fp32 target's bytes (drafting pays at once) but more than
    the target's own Q4_1 blocks, where no draft can repay its cost and none is made."""
    spec = {"method": "draft_model", "model": default_gguf_path, "quantization": "int8", "num_speculative_tokens": 4}
    llm = LLM(max_model_len=512, kv_cache_memory_bytes=64 << 20, speculative_config=spec, gguf_dequantize=dequantize)
    runner = llm.llm_engine.runner
    prior = runner.draft_policy.options[0].prior_drafting_cost
    assert prior == runner.proposer.needs.drafting_cost
    out = llm.generate([{"prompt_token_ids": list(range(100, 160))}],
                       SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    if dequantize:
        assert 0.2 < prior < 0.35 and out.metrics.num_drafts > 0
    else:
        assert prior > 1.0 and out.metrics.num_drafts == 0
