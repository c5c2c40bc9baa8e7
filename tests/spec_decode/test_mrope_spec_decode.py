"""Every proposer keeps greedy equivalence on an M-RoPE (Qwen2-VL family) target.

A tiny random Qwen2-VL saved as a HF folder: the runner builds [3, N] positions, the drafter is given
the target's positions, and a self-draft must accept every draft (a drafter fed wrong positions or KV
slots would not).
"""
import pytest
import torch

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.spec_decode.proposer import DrafterNeeds, TargetStates
from specserve.tokenizer import load_tokenizer
from tests.models.test_qwen2_vl_parity import tiny_qwen2_vl

ENGINE = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=24, block_size=8, kv_cache_memory_bytes=64 << 20)
PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_vl")
    tiny_qwen2_vl().save_pretrained(str(path))
    # Any tokenizer whose ids cover the tiny vocabulary works: outputs are compared as token ids.
    load_tokenizer(None).backend.save(str(path / "tokenizer.json"))
    return str(path)


@pytest.fixture(scope="module")
def prompts_and_reference(folder):
    g = torch.Generator().manual_seed(0)
    motifs = [torch.randint(3, 150, (n,), generator=g).tolist() for n in (5, 7, 4, 9, 6, 3)]
    prompts = [{"prompt_token_ids": m * r} for m, r in zip(motifs, (3, 2, 6, 3, 4, 10))]
    plain = LLM(model=folder, **ENGINE)
    assert plain.llm_engine.runner.uses_mrope
    return prompts, [o.outputs[0].token_ids for o in plain.generate(prompts, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    {"method": "suffix", "num_speculative_tokens": 4},
    {"method": "draft_model", "num_speculative_tokens": 3},
])
def test_every_proposer_keeps_greedy_output_under_mrope(spec, folder, prompts_and_reference):
    prompts, reference = prompts_and_reference
    if spec["method"] == "draft_model":
        spec = dict(spec, model=folder)
    llm = LLM(model=folder, speculative_config=dict(spec, adaptive_draft_length=False), **ENGINE)
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    m = llm.get_metrics()
    assert m.num_drafts > 0
    if spec["method"] == "draft_model":
        assert m.num_accepted_tokens == m.num_draft_tokens  # self-draft: positions and slots right


@pytest.mark.parametrize("states", [TargetStates.NONE, TargetStates.ACCEPTED, TargetStates.ALL])
def test_drafters_get_the_target_states_they_declare(states, folder, prompts_and_reference):
    """A drafter declaring ACCEPTED gets, per sampling request, the kept tokens of the step with the
    [3, T] positions the target computed them at (text: three equal rows, the absolute index); one
    declaring ALL also gets partial prompt chunks, so over the run its rows cover every token of every
    request once, in order; one declaring NONE gets no rows."""
    prompts, reference = prompts_and_reference
    llm = LLM(model=folder, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                "adaptive_draft_length": False}, **ENGINE)
    runner = llm.llm_engine.runner
    runner.proposer.needs = DrafterNeeds(target_states=states)
    seen = []
    propose = runner.proposer.propose
    # histories keep growing after the call: copy them
    runner.proposer.propose = lambda inputs: (seen.append(
        (inputs, {rid: list(state.token_ids) for rid, state in runner.requests.items()})), propose(inputs))[1]
    outs = llm.generate(prompts[:3], PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference[:3]
    assert seen
    covered: dict[str, int] = {}  # per request: tokens [0, n) whose rows were given
    partial_chunks = 0
    last_history_len: dict[str, int] = {}
    for inputs, histories in seen:
        if states is TargetStates.NONE:
            assert inputs.target_token_ids.numel() == 0 and inputs.target_req_ids == []
            continue
        expected_ids = inputs.req_ids if states is TargetStates.ACCEPTED else None
        assert expected_ids is None or inputs.target_req_ids == expected_ids
        partial_chunks += len(set(inputs.target_req_ids) - set(inputs.req_ids))
        pos = inputs.target_positions
        assert pos.shape == (3, len(inputs.target_token_ids)) and torch.equal(pos[0], pos[1])
        assert torch.equal(pos[0], pos[2]) and inputs.target_hidden_states.shape[0] == pos.shape[1]
        for j, rid in enumerate(inputs.target_req_ids):
            lo, hi, start = inputs.cu_num_tokens[j], inputs.cu_num_tokens[j + 1], inputs.target_start[j]
            assert pos[0, lo:hi].tolist() == list(range(start, start + hi - lo))
            assert inputs.target_token_ids[lo:hi].tolist() == histories[rid][start:start + hi - lo]
            if rid in inputs.req_ids:  # kept rows end right before the token sampled last
                assert start + hi - lo == len(histories[rid]) - 1
            if states is TargetStates.ALL:
                assert start == covered.get(rid, 0)  # no gap, no repeat: rejected tails were dropped
                covered[rid] = start + hi - lo
        for i, rid in enumerate(inputs.req_ids):  # the next input's position, by the target's rule
            assert inputs.next_positions[:, i].tolist() == [len(histories[rid]) - 1] * 3
            last_history_len[rid] = len(histories[rid]) - 1
    if states is TargetStates.ALL:
        assert partial_chunks > 0  # the 24-token budget split prompts into chunks
        assert covered == last_history_len  # every token before the last sampled one, each once
