"""Logits parity with transformers for tiny random Llama-family models through the paged KV cache."""
import pytest
import torch

from specserve.engine.kv_cache_manager import KVCacheManager
from specserve.engine.request import Request
from specserve.engine.scheduler import Scheduler, SchedulerConfig
from specserve.models.registry import build_model
from specserve.sampling_params import SamplingParams
from specserve.worker.model_runner import ModelRunner
from tests.tiny_models import hf_config_dict, hf_state_dict, tiny_hf_model

CASES = [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True), ("qwen3", False),
         ("qwen3", True), ("mistral", False)]


def _reference_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1].float()


def _run_steps(model, prompts: list[list[int]], num_decode: int, token_budget: int, hf):
    """Drive scheduler + runner by hand, returning per request the max |logits - reference|."""
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=token_budget, max_model_len=128), kv)
    runner = ModelRunner(model, 64, 4, eos_token_ids=set(), vocab_size=model.config.vocab_size, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=num_decode + 1, ignore_eos=True)
    for i, p in enumerate(prompts):
        sched.add_request(Request(str(i), p, params))
    worst = {str(i): 0.0 for i in range(len(prompts))}
    steps = {str(i): 0 for i in range(len(prompts))}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        runner._update_states(out)
        batch = runner.prepare_inputs(out)
        with torch.inference_mode():
            hidden, _ = model.forward(batch.input_ids, batch.positions, batch.attn, runner.kv_caches)
            logits = model.compute_logits(hidden[batch.logits_indices])
        sampled = {rid: [] for rid in out.req_ids}
        for row, rid in enumerate(batch.sample_req_ids):
            ref = _reference_logits(hf, runner.requests[rid].token_ids)
            worst[rid] = max(worst[rid], (logits[row] - ref).abs().max().item())
            tok = int(ref.argmax())
            sampled[rid] = [tok]
            runner.requests[rid].append([tok])
            steps[rid] += 1
        sched.update_from_output(out, sampled)
    assert all(s == num_decode + 1 for s in steps.values())
    return worst


@pytest.mark.parametrize("kind,tie", CASES)
def test_prefill_and_decode_match_transformers(kind, tie):
    hf = tiny_hf_model(kind, tie=tie)
    model = build_model(hf_config_dict(hf), hf_state_dict(hf), dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (13, 5, 22)]
    # Token budget 7: prompts are prefetched in chunks, decodes ride along with other prefills.
    worst = _run_steps(model, prompts, num_decode=10, token_budget=7, hf=hf)
    assert max(worst.values()) < 1e-4, worst


def test_long_prefill_takes_the_unbatched_path():
    hf = tiny_hf_model("llama")
    model = build_model(hf_config_dict(hf), hf_state_dict(hf), dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (40, 3)]
    worst = _run_steps(model, prompts, num_decode=3, token_budget=64, hf=hf)
    assert max(worst.values()) < 1e-4, worst
