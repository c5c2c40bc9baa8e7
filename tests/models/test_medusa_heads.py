"""Medusa heads against a direct reference: per head, ResBlocks y = x + SiLU(W x + b), then its own vocabulary
projection (or the target's LM head), applied to the target's final post-norm states."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.models.drafter_loader import load_drafter_checkpoint
from specserve.models.medusa import MedusaHeads
from specserve.models.registry import build_model
from specserve.ops.attention import build_attention_metadata, kv_caches
from specserve.ops.kernels import kernel_usable
from tests.models.drafter_checkpoints import WrittenDrafter, write_medusa
from tests.tiny_models import hf_config_dict, hf_state_dict, tiny_hf_model


def target_and_states(num_tokens: int = 9):
    """A tied-head tiny Llama, and its final post-norm states [T, H] over a random prompt."""
    hf = tiny_hf_model("llama", tie=True, initializer_range=0.1)
    model = build_model(hf_config_dict(hf), hf_state_dict(hf), dtype=torch.float32)
    tokens = torch.randint(0, 160, (num_tokens,), generator=torch.Generator().manual_seed(2))
    blocks = list(range(-(-num_tokens // 4)))
    meta = build_attention_metadata([num_tokens], [num_tokens], [blocks], 4, torch.arange(num_tokens),
                                    kernel_usable(torch.float32))
    caches = kv_caches(model.kv_cache_shape(len(blocks), 4), torch.float32, model.num_layers)
    with torch.inference_mode():
        hidden, _ = model.forward(tokens, torch.arange(num_tokens), meta, caches)
    return hf, model, hidden


def reference_logits(written: WrittenDrafter, hidden: torch.Tensor, num_heads: int, num_layers: int,
                     lm_head: torch.Tensor, vocab: int) -> torch.Tensor:
    """[K, N, V]: head k = ResBlocks then its projection (the target's lm_head when it has none)."""
    out = []
    for k in range(num_heads):
        x = hidden
        for j in range(num_layers):
            w, b = written.medusa_block(k, j)
            x = x + F.silu(F.linear(x, w, b))
        own = written.medusa_lm_head(k, num_layers)
        logits = x @ (lm_head if own is None else own).t()
        if "token_map" in written.tensors:
            full = torch.full((x.shape[0], vocab), float("-inf"))
            full[:, written.tensors["token_map"]] = logits
            logits = full
        out.append(logits)
    return torch.stack(out)


@pytest.mark.parametrize("case", [
    dict(layout="fasterdecoding"),
    dict(layout="fasterdecoding", weights_format="pt", num_layers=2),
    dict(layout="fasterdecoding", own_lm_heads=False, medusa_head_prefix=True),  # Medusa-2: the target's head
    dict(layout="vllm", fc_bias=False, num_heads=4),
    dict(layout="vllm", num_layers=2, truncated_vocab_size=64),
], ids=["fd", "fd-pt-2layers", "fd-v2-prefixed", "vllm-nobias", "vllm-truncated"])
def test_heads_match_reference(tmp_path, backend, case):
    hf, target, hidden = target_and_states()
    written = write_medusa(str(tmp_path), hf.config, **case)
    num_heads, num_layers = case.get("num_heads", 3), case.get("num_layers", 1)
    heads = MedusaHeads(load_drafter_checkpoint(written.folder, "medusa"), target)
    assert heads.num_heads == num_heads
    with torch.inference_mode():
        logits = heads.forward(hidden)
        greedy = heads.greedy_tokens(hidden)
    ref = reference_logits(written, hidden, num_heads, num_layers, target.embed_tokens, 160)
    assert logits.shape == (num_heads, hidden.shape[0], 160) and greedy.shape == (hidden.shape[0], num_heads)
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(logits))
    assert (logits[finite] - ref[finite]).abs().max().item() < 1e-4
    assert torch.equal(greedy, ref.argmax(-1).t())
    # The drafts vary: across rows, and across heads.
    assert len(set(greedy[:, 0].tolist())) > 1 and any(len(set(row.tolist())) > 1 for row in greedy)


def test_resblocks_are_not_identity(tmp_path):
    """Skipping the ResBlocks (x straight into the projections) changes the drafts: the weights matter."""
    hf, target, hidden = target_and_states()
    written = write_medusa(str(tmp_path), hf.config)
    heads = MedusaHeads(load_drafter_checkpoint(written.folder), target)
    with torch.inference_mode():
        logits = heads.forward(hidden)
    skipped = torch.stack([hidden @ written.medusa_lm_head(k, 1).t() for k in range(3)])
    assert (logits - skipped).abs().max().item() > 1e-1


def test_int8_heads_are_close(tmp_path):
    hf, target, hidden = target_and_states()
    written = write_medusa(str(tmp_path), hf.config)
    ckpt = load_drafter_checkpoint(written.folder)
    with torch.inference_mode():
        exact = MedusaHeads(ckpt, target).forward(hidden)
        approx = MedusaHeads(ckpt, target, weight_dtype="int8").forward(hidden)
    assert (exact - approx).abs().max().item() < 0.05 * exact.abs().max().item()
