"""Step-cost calibration before the first request: the target's decode and verification steps timed on a
dummy context, so the draft policy prices drafts from this machine's step costs from the first step instead
of a prior: one request verifying 0..k drafts, and batches of requests adding one and two tokens each.
"""
from __future__ import annotations

import statistics
import time

import torch

from specserve.ops.attention import paged_metadata

# A dummy context of this many tokens, each step size timed this many times after one untimed run (its median
# is kept), and the batch sizes timed with one and two tokens per request for the batched price (those up to
# max_num_seqs).
CALIBRATION_CONTEXT = 256
CALIBRATION_REPEATS = 3
CALIBRATION_BATCHES = (2, 4, 8, 16, 32, 64)


class StepCalibrator:
    """Times a runner's steps and seeds its draft policy. The dummy steps' KV goes to blocks no request holds
    yet (it runs before any request; every request writes its KV before reading it)."""

    def __init__(self, runner) -> None:
        self.runner = runner

    @torch.inference_mode()
    def run(self, num_blocks: int, max_num_seqs: int) -> None:
        runner = self.runner
        k = max(o.max_drafts for o in runner.draft_policy.options)
        context = min(CALIBRATION_CONTEXT, runner.max_model_len - k - 1, num_blocks * runner.block_size - k - 1)
        if context < 1:
            return
        blocks = list(range(-(-(context + k + 1) // runner.block_size)))
        self.timed_step(1, 1, context, blocks)  # first touches of buffers and caches: not kept
        single = {q: self.timed_step(1, q, context, blocks) for q in range(1, k + 2)}
        batched = {n: self.timed_pair(n, context, blocks) for n in CALIBRATION_BATCHES if n <= max_num_seqs}
        runner.draft_policy.seed_step_costs(single, batched)

    def timed_pair(self, num_requests: int, context: int, blocks: list[int]) -> tuple[float, float]:
        """Seconds of a step of num_requests requests adding one token each, and two each: timed in turns, the
        second as the first plus the median of the differences between neighbouring turns, so a host that is
        slowed for a while (another process) slows both sides of a difference."""
        ones, extra = [], []
        for _ in range(CALIBRATION_REPEATS):
            one = self.timed_step(num_requests, 1, context, blocks, 1)
            ones.append(one)
            extra.append(self.timed_step(num_requests, 2, context, blocks, 1) - one)
        one = statistics.median(ones)
        return one, one + statistics.median(extra)

    def timed_step(self, num_requests: int, num_tokens: int, context: int, blocks: list[int],
                   repeats: int = CALIBRATION_REPEATS) -> float:
        """Median seconds of `repeats` decode steps (after an untimed one) of num_requests requests, each
        adding num_tokens tokens after `context` tokens of the same blocks (dummy token ids; their K/V lands
        in those blocks)."""
        runner = self.runner
        rows = num_requests * num_tokens
        ids = torch.zeros(rows, dtype=torch.long)
        positions = runner.layout_positions(torch.arange(context, context + num_tokens).repeat(num_requests))
        attn = paged_metadata([num_tokens] * num_requests, [context + num_tokens] * num_requests,
                              [blocks] * num_requests, runner.block_size, runner.attention_kernel)
        seconds = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            with runner.thread_policy.run(rows):
                hidden, _ = runner.model.forward(ids, positions, attn, runner.kv_caches, None)
                runner.model.greedy_tokens(hidden)
            seconds.append(time.perf_counter() - start)
        return statistics.median(seconds[1:])
