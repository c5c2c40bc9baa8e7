"""Every drafter on prompts with images (M-RoPE rows differ, text after an image continues from a per-request
offset): greedy output equals plain decoding, and a self-draft given the target's positions has every draft
accepted, which fails as soon as the drafter gets 1-row positions or loses the offset."""
import pytest
import torch

from specserve.llm import LLM
from specserve.models.qwen2_vl import MRopePositions
from specserve.sampling_params import SamplingParams
from specserve.spec_decode.proposer import DraftInputs
from tests.models.drafter_checkpoints import write_eagle, write_eagle3, write_medusa
from tests.multimodal.test_generate_images import IMAGES
from tests.multimodal.tiny_vl import image_prompt, save_tiny_vl, tiny_vl

ENGINE = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=32, block_size=8, kv_cache_memory_bytes=64 << 20)
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts() -> list[dict]:
    """Repeated motifs around images (so lookups find matches), batched with a text-only prompt."""
    g = torch.Generator().manual_seed(3)
    motif = [torch.randint(3, 117, (n,), generator=g).tolist() for n in (4, 5, 3, 6)]
    return [
        {"prompt_token_ids": image_prompt([motif[0] * 3, motif[0] * 2 + motif[1]]),
         "multi_modal_data": {"image": IMAGES[1]}},
        {"prompt_token_ids": image_prompt([motif[2] * 2, motif[3] * 2, motif[2] * 3]),
         "multi_modal_data": {"image": [IMAGES[2], IMAGES[0]]}},
        {"prompt_token_ids": motif[1] * 4},
        {"prompt_token_ids": image_prompt([[], motif[3] * 3]), "multi_modal_data": {"image": IMAGES[3]}},
    ]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def target(request, tmp_path_factory):
    hf = tiny_vl(request.param)
    folder = save_tiny_vl(hf, tmp_path_factory.mktemp(request.param))
    plain = LLM(model=folder, **ENGINE).generate(_prompts(), PARAMS, use_tqdm=False)
    return hf, folder, [o.outputs[0].token_ids for o in plain]


def _run(folder: str, spec: dict):
    llm = LLM(model=folder, speculative_config=dict(spec, adaptive_draft_length=False), **ENGINE)
    outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.get_metrics()


def _spec(method: str, hf, folder: str, tmp_path) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": 4}
    if method == "draft_model":
        return {"method": "draft_model", "num_speculative_tokens": 3, "model": folder}
    if method == "eagle":
        return {"method": "eagle", "num_speculative_tokens": 3,
                "model": write_eagle(str(tmp_path), hf.config, qkv_bias=True).folder}
    if method == "eagle3":
        return {"method": "eagle3", "num_speculative_tokens": 3,
                "model": write_eagle3(str(tmp_path), hf.config, draft_vocab_size=64, aux_layer_ids=[0, 2, 1]).folder}
    if method == "medusa":
        return {"method": "medusa", "num_speculative_tokens": 3, "model": write_medusa(str(tmp_path), hf.config).folder}
    return {"method": "auto"}  # lookups plus the target's own weights in int8


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "eagle", "eagle3", "medusa", "auto"])
def test_every_drafter_keeps_plain_output_on_image_prompts(method, target, tmp_path):
    hf, folder, plain = target
    outputs, metrics = _run(folder, _spec(method, hf, folder, tmp_path))
    assert outputs == plain
    assert metrics.num_drafts > 0
    if method == "draft_model":  # the target's own weights: right positions make every draft right
        assert metrics.num_accepted_tokens == metrics.num_draft_tokens


def _one_row(self, i, start, end, mrope):
    return torch.arange(start, end).expand(3, -1) if mrope else torch.arange(start, end)


def _no_offset(self, i, start, end, mrope):
    request = self.mrope_positions[i] if self.mrope_positions else None
    if request is None:
        return _one_row(self, i, start, end, mrope)
    return MRopePositions(request.prompt, 0).range(start, end)


@pytest.mark.parametrize("wrong", [_one_row, _no_offset], ids=["one-row", "no-offset"])
def test_a_drafter_given_wrong_positions_loses_acceptance(wrong, target, monkeypatch):
    """The self-draft's acceptance is the check: with the positions of text (or without the image
    offset) its drafts differ from the target's tokens, so some are rejected (output stays exact)."""
    _, folder, plain = target
    monkeypatch.setattr(DraftInputs, "positions", wrong)
    outputs, metrics = _run(folder, {"method": "draft_model", "num_speculative_tokens": 3, "model": folder})
    assert outputs == plain
    assert metrics.num_accepted_tokens < metrics.num_draft_tokens


def test_eagle_reads_exactly_the_positions_the_target_saw(target, tmp_path):
    """The rows EAGLE writes carry the target's [3, T] positions (images included), and its first draft
    position is the next token's: index + the request's offset."""
    hf, folder, plain = target
    llm = LLM(model=folder, speculative_config=dict(_spec("eagle", hf, folder, tmp_path), adaptive_draft_length=False),
              **ENGINE)
    runner = llm.llm_engine.runner
    propose, seen = runner.proposer.propose, {"rows": 0, "image_rows": 0}

    def expected(rid: str, start: int, end: int) -> torch.Tensor:
        mrope = runner.requests[rid].mrope
        return mrope.range(start, end) if mrope is not None else torch.arange(start, end).expand(3, -1)

    def checking(inputs):
        for j, rid in enumerate(inputs.target_req_ids):
            lo, hi, start = inputs.cu_num_tokens[j], inputs.cu_num_tokens[j + 1], inputs.target_start[j]
            rows = inputs.target_positions[:, lo:hi]
            assert torch.equal(rows, expected(rid, start, start + hi - lo))
            seen["rows"] += hi - lo
            seen["image_rows"] += int((rows[1] != rows[2]).sum())
        for i, rid in enumerate(inputs.req_ids):
            n = len(inputs.token_ids[i])
            assert torch.equal(inputs.next_positions[:, i:i + 1], expected(rid, n - 1, n))
        return propose(inputs)

    runner.proposer.propose = checking
    outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert seen["image_rows"] > 0 and seen["rows"] > seen["image_rows"]
