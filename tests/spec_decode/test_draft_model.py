"""Draft-model configuration errors are caught at start, with a message saying what is wrong."""
import pytest
import torch

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from tests.tiny_models import tiny_hf_model


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
    runner.draft_policy.observe_drafting = lambda n, s: (seen.append(n), observe(n, s))
    calls = []
    propose = runner.proposer.propose
    runner.proposer.propose = lambda inputs: (calls.append(len(inputs.target_token_ids)), propose(inputs))[1]
    out = llm.generate([{"prompt_token_ids": list(range(1, 60))}],
                       SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    assert out.metrics.num_drafts > 1 and calls[0] == 59  # the first call came with the whole prompt
    # every drafting call but the one right after the prefill, each with the 2 drafts it made
    assert len(seen) == len(calls) - 1 and set(seen) == {2}


def test_a_self_draft_takes_the_targets_kv_instead_of_recomputing_it(default_gguf_path):
    """The target's own weights in int8: the drafter copies the target's verified KV of the history and
    feeds only the newest token, so it never prefills the prompt itself; its KV rows for the history are
    then the target's, bit for bit, and greedy output stays plain decoding's."""
    from specserve.ops.kernels import kernel_enabled

    spec = {"method": "draft_model", "model": default_gguf_path, "quantization": "int8",
            "num_speculative_tokens": 3, "adaptive_draft_length": False}
    llm = LLM(max_model_len=512, block_size=16, speculative_config=spec)
    drafter, runner = llm.llm_engine.runner.proposer, llm.llm_engine.runner
    assert drafter.copies_target_kv == kernel_enabled()
    if not drafter.copies_target_kv:
        pytest.skip("KV copies need the C kernels")
    fed = []
    forward = drafter.model.forward
    drafter.model.forward = lambda ids, *a: (fed.append(len(ids)), forward(ids, *a))[1]
    prompt = {"prompt_token_ids": list(range(100, 180))}
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    captured = {}
    finish = runner._update_states

    def keep_tables(sched):  # the request's blocks, read before the runner forgets a finished request
        for rid, state in runner.requests.items():
            captured[rid] = (list(state.block_ids), len(state.token_ids))
        finish(sched)

    runner._update_states = keep_tables
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert max(fed) == 1  # one token per forward: the prompt was never fed to the drafter
    plain = LLM(max_model_len=512, block_size=16)
    assert out.outputs[0].token_ids == plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    (rid, (target_table, _)), = captured.items()
    state = drafter.requests.get(rid)
    assert state is not None  # finished requests are forgotten at the next drafting call
    bs = 16
    for p in range(0, state.num_computed - 1, 7):
        t_slot = target_table[p // bs] * bs + p % bs
        d_slot = state.block_ids[p // bs] * bs + p % bs
        for (tk, tv), (dk, dv) in zip(runner.kv_caches, drafter.kv_caches):
            assert torch.equal(tk[t_slot // bs, t_slot % bs], dk[d_slot // bs, d_slot % bs])
            assert torch.equal(tv[t_slot // bs, t_slot % bs], dv[d_slot // bs, d_slot % bs])
