"""Every proposer keeps greedy equivalence on an M-RoPE (Qwen2-VL family) target.

A tiny random Qwen2-VL saved as a HF folder: the runner builds [3, N] positions, the drafter is given
the target's positions, and a self-draft must accept every draft (a drafter fed wrong positions or KV
slots would not).
"""
import pytest
import torch

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.tokenizer import load_tokenizer
from tests.models.test_qwen2_vl_parity import tiny_qwen2_vl

ENGINE = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=24, block_size=8)
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


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_drafters_get_the_targets_own_positions_and_tokens(method, folder, prompts_and_reference):
    """A proposer that reads target states gets, per request, the accepted tokens of the step with the
    [3, T] positions the target computed them at (text: three equal rows, the absolute index); prompt
    lookup and suffix read token ids only and get no rows."""
    prompts, _ = prompts_and_reference
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive_draft_length": False}
    llm = LLM(model=folder, speculative_config=dict(spec, model=folder) if method == "draft_model" else spec,
              **ENGINE)
    runner = llm.llm_engine.runner
    seen = []
    propose = runner.proposer.propose
    # histories keep growing after the call: copy them
    runner.proposer.propose = lambda inputs: (seen.append((inputs, [list(t) for t in inputs.token_ids])),
                                              propose(inputs))[1]
    llm.generate(prompts[:3], PARAMS, use_tqdm=False)
    assert seen
    for inputs, histories in seen:
        if method == "ngram":
            assert inputs.target_token_ids.numel() == 0 and inputs.cu_num_tokens == [0] * (len(inputs.req_ids) + 1)
            continue
        pos = inputs.target_positions
        assert pos.shape == (3, len(inputs.target_token_ids)) and torch.equal(pos[0], pos[1])
        assert torch.equal(pos[0], pos[2]) and inputs.target_hidden_states.shape[0] == pos.shape[1]
        for i, history in enumerate(histories):
            lo, hi = inputs.cu_num_tokens[i], inputs.cu_num_tokens[i + 1]
            # the tokens fed this step and kept: they end right before the token sampled last
            assert pos[0, lo:hi].tolist() == list(range(len(history) - 1 - (hi - lo), len(history) - 1))
            assert inputs.target_token_ids[lo:hi].tolist() == history[len(history) - 1 - (hi - lo):-1]
            assert hi - lo >= len(inputs.sampled_token_ids[i])  # a verification keeps one row per new token
