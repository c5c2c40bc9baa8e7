"""Drives the real scheduler and model runner by hand so tests can compare logits step by step."""
from __future__ import annotations

from typing import Callable

import torch

from specserve.engine.kv_cache_manager import KVCacheManager
from specserve.engine.request import Request
from specserve.engine.scheduler import Scheduler, SchedulerConfig
from specserve.sampling_params import SamplingParams
from specserve.worker.model_runner import ModelRunner


def max_logit_errors(model, prompts: list[list[int]], num_decode: int, token_budget: int,
                     reference: Callable[[list[int]], torch.Tensor],
                     positions: Callable | None = None) -> dict[str, float]:
    """Per request, the max |logits - reference(tokens)| over its prefill and num_decode decode steps.

    Decoding follows the reference's argmax. `positions(runner, sched_out, batch)`, if given, supplies
    the positions passed to the model (e.g. [3, N] M-RoPE rows) instead of the runner's.
    """
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=token_budget, max_model_len=128), kv)
    runner = ModelRunner(model, 4, eos_token_ids=set(), max_model_len=128)
    runner.initialize_kv_cache(64)
    params = SamplingParams(temperature=0.0, max_tokens=num_decode + 1, ignore_eos=True)
    for i, p in enumerate(prompts):
        sched.add_request(Request(str(i), p, params))
    worst = {str(i): 0.0 for i in range(len(prompts))}
    steps = {str(i): 0 for i in range(len(prompts))}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        runner._update_states(out)
        batch = runner.prepare_inputs(out)
        pos = batch.positions if positions is None else positions(runner, out, batch)
        with torch.inference_mode():
            hidden, _ = model.forward(batch.input_ids, pos, batch.attn, runner.kv_caches)
            logits = model.compute_logits(hidden[batch.logits_indices])
        sampled = {}
        for row, rid in enumerate(batch.sample_req_ids):
            ref = reference(runner.requests[rid].token_ids)
            worst[rid] = max(worst[rid], (logits[row] - ref).abs().max().item())
            tok = int(ref.argmax())
            sampled[rid] = [tok]
            runner.requests[rid].append([tok])
            steps[rid] += 1
        sched.update_from_output(out, sampled)
    assert all(s == num_decode + 1 for s in steps.values())
    return worst
