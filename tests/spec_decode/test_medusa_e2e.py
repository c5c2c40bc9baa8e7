"""Medusa end to end: greedy output equals plain decoding (mixed batches, chunked prefill, preemption, an
M-RoPE target), every draft equals each head's argmax over the target's final post-norm state at the last
accepted position, and a checkpoint that does not fit the target fails when the LLM is built."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from tests.models.drafter_checkpoints import WrittenDrafter, rewrite_tensors, target_fields, write_medusa
from tests.models.test_medusa_heads import reference_logits
from tests.spec_decode.test_eagle_e2e import (K, DraftStep, Target, assert_refused_at_build, hf_states,
                                              partial_acceptances, run_drafter)

NUM_HEADS = 3


def counting_medusa(folder: str, hf) -> WrittenDrafter:
    """FasterDecoding heads with zero ResBlocks (y = x + SiLU(0) = x) and head k's projection row v =
    embed[v - (k + 2)]: from the state h_t of token x_t, head k drafts x_t + k + 2, the counting target's
    x_{t+2+k}; after a jump (h_t nearer another token's embedding) the heads count on from the jump."""
    written = write_medusa(folder, hf.config, layout="fasterdecoding", num_heads=NUM_HEADS)
    embed = hf.model.embed_tokens.weight.detach()
    updates = {}
    for k in range(NUM_HEADS):
        weight, bias = written.medusa_block(k, 0)
        updates[f"{k}.0.linear.weight"] = torch.zeros_like(weight)
        updates[f"{k}.0.linear.bias"] = torch.zeros_like(bias)
        updates[f"{k}.1.weight"] = embed.roll(k + 2, 0).clone()
    return rewrite_tensors(written, updates)


# case -> (writer, ResBlocks per head)
CASES: dict[str, tuple[Callable[[str, object], WrittenDrafter], int]] = {
    "fasterdecoding": (lambda folder, hf: write_medusa(folder, hf.config, layout="fasterdecoding"), 1),
    # Medusa-2 "version 2": no projection of their own, the target's LM head; keys under medusa_head.
    "fasterdecoding-v2": (lambda folder, hf: write_medusa(folder, hf.config, layout="fasterdecoding", num_layers=2,
                                                          own_lm_heads=False, medusa_head_prefix=True), 2),
    "vllm-truncated": (lambda folder, hf: write_medusa(folder, hf.config, layout="vllm", truncated_vocab_size=64), 1),
    "counting": (counting_medusa, 1),
    "mrope-fasterdecoding": (lambda folder, hf: write_medusa(folder, hf.config, layout="fasterdecoding"), 1),
}


class MedusaReference:
    """Head k's draft after history x_0..x_{n-1}: argmax of its ResBlocks and projection (or the target's LM
    head) over h_{n-2}, transformers' final post-norm state of the token whose logits gave x_{n-1}."""

    def __init__(self, hf, written: WrittenDrafter, num_layers: int, target: Target) -> None:
        self.hf, self.written, self.num_layers = hf, written, num_layers
        self.lm_head = hf.get_output_embeddings().weight.detach()
        self.vocab_size = target_fields(hf.config)["vocab_size"]
        self.states = {tuple(seq): hf_states(hf, seq, target.layout(torch.arange(len(seq))))[0]
                       for seq in target.sequences()}

    def drafts(self, history: list[int], k: int) -> list[int]:
        (states,) = [f for seq, f in self.states.items() if list(seq[: len(history)]) == history]
        logits = reference_logits(self.written, states[len(history) - 2][None], NUM_HEADS, self.num_layers,
                                  self.lm_head, self.vocab_size)  # [heads, 1, V]
        return logits[:k, 0].argmax(-1).tolist()


@dataclass
class Run:
    target: Target
    reference: MedusaReference
    outputs: list[list[int]]
    metrics: object
    steps: list[DraftStep]
    num_partial_prefills: int


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> Callable[[str], Run]:
    """case -> its run, made once per module."""
    done: dict[str, Run] = {}

    def get(case: str) -> Run:
        if case not in done:
            target = request.getfixturevalue("qwen" if case.startswith("mrope") else "llama")
            write, num_layers = CASES[case]
            written = write(str(tmp_path_factory.mktemp(case)), target.hf)
            result = run_drafter(target, written)
            done[case] = Run(target, MedusaReference(target.hf, written, num_layers, target), result.outputs,
                             result.llm.get_metrics(), result.steps, result.num_partial_prefills)
        return done[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_output_equals_plain_decoding(case, runs):
    run = runs(case)
    assert run.outputs == run.target.plain
    m = run.metrics
    assert m.num_preemptions > 0
    assert run.num_partial_prefills > 0  # prompts were split into chunks
    assert m.num_draft_tokens > 0 and m.num_accepted_tokens < m.num_draft_tokens


def test_heads_that_draft_well_are_accepted_in_full_and_in_part(runs):
    m = runs("counting").metrics
    assert m.num_accepted_tokens > 0.3 * m.num_draft_tokens
    assert partial_acceptances(runs("counting").steps) > 0
    assert m.accepted_per_position[K - 1] > 0  # all K accepted: the bonus token follows


@pytest.mark.parametrize("case", list(CASES))
def test_drafts_are_each_heads_argmax_at_the_last_accepted_position(case, runs):
    """After chunked prefill, preemption and partly accepted drafts alike, the heads read the state of the
    last accepted token (not a rejected draft's, not the bonus token's)."""
    run = runs(case)
    compared = 0
    for number, step in enumerate(run.steps):
        for rid, history, n, drafts in zip(step.req_ids, step.histories, step.num_drafts, step.drafts):
            if n:
                assert drafts == run.reference.drafts(history, n), f"step {number}, request {rid}"
                compared += 1
    assert compared > 20
    if case == "counting":
        assert partial_acceptances(run.steps) > 0  # steps right after a partial rejection were compared


# ---------------------------------------------------------------- checkpoints that do not fit


def _no_heads(folder: str, hf) -> WrittenDrafter:
    written = write_medusa(folder, hf.config, layout="fasterdecoding")
    stray = {"norm.weight": torch.ones(hf.config.hidden_size)}  # a tensor, but no head
    return rewrite_tensors(written, {**{name: None for name in written.tensors}, **stray})


BAD_CHECKPOINTS = {
    "no-heads": (_no_heads, r"no Medusa heads found \(expected keys like '0\.0\.linear\.weight'.*found 1 tensor\(s\) "
                            r"\['norm\.weight'\]"),
    "vocabulary": (lambda folder, hf: write_medusa(folder, {**target_fields(hf.config), "vocab_size": 100},
                                                   layout="vllm"),
                   r"tensor 'lm_heads\.0\.weight' has shape \[100, 64\], expected \[160, 64\]"),
    "hidden-size": (lambda folder, hf: write_medusa(folder, {**target_fields(hf.config), "hidden_size": 32}),
                    r"tensor 'blocks\.0\.layers\.0\.weight' \(in the file: '0\.0\.linear\.weight'\) has shape "
                    r"\[32, 32\], expected \[64, 64\]"),
}


@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_a_checkpoint_that_does_not_fit_fails_when_the_llm_is_built(case, llama, tmp_path):
    assert_refused_at_build(llama, str(tmp_path), *BAD_CHECKPOINTS[case])
