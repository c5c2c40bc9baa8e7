"""EAGLE-1 and EAGLE-3 heads against a direct reference written from the drafter notes.

The heads run a prefill and single-token draft steps through a paged one-layer KV cache whose blocks are
scattered in the pool; the reference recomputes the whole sequence with full causal attention (no paging)
from the tensors exactly as the checkpoint writer stored them.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.models.drafter_loader import load_drafter_checkpoint
from specserve.models.eagle import Eagle3Head, EagleHead
from specserve.models.registry import build_model
from specserve.ops.attention import build_attention_metadata, kv_caches
from specserve.ops.kernels import kernel_usable
from tests.models.drafter_checkpoints import WrittenDrafter, target_fields, write_eagle, write_eagle3
from tests.tiny_models import hf_config_dict, hf_state_dict, tiny_hf_model

BLOCK_SIZE = 4
TOL = 2e-4


def llama_target(num_layers: int = 8, aux: tuple[int, ...] = ()):
    """A SmolLM2-like (tied head) random transformers Llama and our model of it."""
    hf = tiny_hf_model("llama", tie=True, num_hidden_layers=num_layers, initializer_range=0.1)
    return hf, build_model(hf_config_dict(hf), hf_state_dict(hf), dtype=torch.float32, aux_hidden_layers=aux)


# ---------------------------------------------------------------- paged driver


class DraftKV:
    """A head's one-layer paged KV cache for several requests, each on its own scattered blocks."""

    def __init__(self, head, tables: list[list[int]]) -> None:
        self.tables = tables
        num_blocks = max(max(t) for t in tables) + 1
        self.cache = kv_caches(head.kv_cache_shape(num_blocks, BLOCK_SIZE), torch.float32, head.num_layers)[0]

    def meta(self, spans: list[tuple[int, int]]):
        """spans: per request (first position, number of tokens), in batch order."""
        slots = [self.tables[r][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                 for r, (start, n) in enumerate(spans) for p in range(start, start + n)]
        return build_attention_metadata([n for _, n in spans], [s + n for s, n in spans], self.tables, BLOCK_SIZE,
                                        torch.tensor(slots), kernel_usable(torch.float32))


def target_pass(model, tokens: list[int], positions: torch.Tensor | None = None):
    """The target over `tokens` in a fresh cache: (final post-norm states [T, H], aux states or None)."""
    n = len(tokens)
    blocks = list(range(-(-n // BLOCK_SIZE)))
    meta = build_attention_metadata([n], [n], [blocks], BLOCK_SIZE, torch.arange(n), kernel_usable(torch.float32))
    caches = kv_caches(model.kv_cache_shape(len(blocks), BLOCK_SIZE), torch.float32, model.num_layers)
    with torch.inference_mode():
        return model.forward(torch.tensor(tokens), torch.arange(n) if positions is None else positions, meta, caches)


# ---------------------------------------------------------------- the reference, from the notes


def ref_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def ref_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, section: list[int] | None = None):
    """[T, head_dim] cos and sin, rotate-half layout; M-RoPE: frequency j reads the row whose section holds j."""
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (torch.arange(half, dtype=torch.float64) * 2 / head_dim)
    if positions.dim() == 1:
        angle = positions.double()[:, None] * inv_freq[None, :]
    else:
        row = torch.repeat_interleave(torch.arange(3), torch.tensor(section))  # [half]
        angle = positions.double().t()[:, row] * inv_freq[None, :]
    angle = torch.cat([angle, angle], dim=-1)
    return angle.cos().float(), angle.sin().float()


def ref_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], -1) * sin[:, None]


def ref_layer(w: WrittenDrafter, t: dict, x: torch.Tensor, residual: torch.Tensor, cos, sin) -> torch.Tensor:
    """The draft decoder layer with full causal attention over all T rows: x [T, in], residual [T, H]."""
    heads, kv_heads, D, eps = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"], t["rms_norm_eps"]
    T = x.shape[0]

    def proj(name):
        bias = w.tensors.get(w.prefix + w.layer_prefix + f"self_attn.{name}_proj.bias")
        return F.linear(x, w.layer(f"self_attn.{name}_proj.weight"), bias)

    q = ref_rope(proj("q").view(T, heads, D), cos, sin)
    k = ref_rope(proj("k").view(T, kv_heads, D), cos, sin).repeat_interleave(heads // kv_heads, dim=1)
    v = proj("v").view(T, kv_heads, D).repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / D ** 0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, heads * D)
    r = residual + attn @ w.layer("self_attn.o_proj.weight").t()
    h = ref_rms(r, w.layer("post_attention_layernorm.weight"), eps)
    mlp = (F.silu(h @ w.layer("mlp.gate_proj.weight").t()) * (h @ w.layer("mlp.up_proj.weight").t()))
    return r + mlp @ w.layer("mlp.down_proj.weight").t()


def ref_eagle1(w, t, embed, tokens, features, cos, sin, swap: bool = False) -> torch.Tensor:
    """g [T, H] = layer(fc(cat(embed(x_{p+1}), f_p))) with no input norm; swap: the wrong concat order."""
    parts = [embed[tokens], features]
    u = F.linear(torch.cat(parts[::-1] if swap else parts, -1), w.tensor("fc.weight"), w.tensors.get("fc.bias"))
    return ref_layer(w, t, u, u, cos, sin)


def ref_eagle3(w, t, embed, tokens, hidden, cos, sin, norm_before_residual=False, swap=False, skip_hidden_norm=False):
    """g [T, H] (pre-norm): z = cat(input_layernorm(embed), hidden_norm(h)); residual h (or hidden_norm(h))."""
    eps = t["rms_norm_eps"]
    e = ref_rms(embed[tokens], w.layer("input_layernorm.weight"), eps)
    hn = hidden if skip_hidden_norm else ref_rms(hidden, w.layer("hidden_norm.weight"), eps)
    z = torch.cat([hn, e] if swap else [e, hn], -1)
    return ref_layer(w, t, z, hn if norm_before_residual else hidden, cos, sin)


def ref_eagle3_logits(w, t, g):
    """[T, Vd] draft logits lm_head(norm(g))."""
    return ref_rms(g, w.tensor("norm.weight"), t["rms_norm_eps"]) @ w.tensor("lm_head.weight").t()


def eagle3_target_ids(w: WrittenDrafter, draft_ids: torch.Tensor) -> torch.Tensor:
    return draft_ids + w.tensor("d2t")[draft_ids]


# ---------------------------------------------------------------- EAGLE-1


def test_eagle_prefill_and_draft_steps_match_reference(tmp_path, backend):
    hf, target = llama_target(num_layers=2)
    written = write_eagle(str(tmp_path), hf.config, fc_bias=True)
    head = EagleHead(load_drafter_checkpoint(written.folder, "eagle"), target)
    t = target_fields(hf.config)
    # 19 > 16 tokens: the PyTorch fallback's one-request prefill path (shorter queries are batched)
    prompt = torch.randint(0, 160, (19,), generator=torch.Generator().manual_seed(3)).tolist()
    hidden, _ = target_pass(target, prompt)
    x_next = int(target.greedy_tokens(hidden[-1:])[0])
    n = len(prompt)
    kv = DraftKV(head, [[6, 2, 9, 4, 0, 7]])  # 24 slots on scattered blocks
    tokens, feats = prompt[1:] + [x_next], hidden  # slot p holds (f_p, x_{p+1})
    with torch.inference_mode():
        g = head.forward(torch.tensor(tokens), feats, torch.arange(n), kv.meta([(0, n)]), kv.cache)
        for step in range(4):
            pos = torch.arange(len(tokens))
            cos, sin = ref_cos_sin(pos, t["head_dim"], t["rope_theta"])
            ref = ref_eagle1(written, t, target.embed_tokens, torch.tensor(tokens), feats, cos, sin)
            rows = g.shape[0]
            assert (g - ref[-rows:]).abs().max().item() < TOL, step
            if step == 0:  # the concat order matters: embedding first
                swapped = ref_eagle1(written, t, target.embed_tokens, torch.tensor(tokens), feats, cos, sin, swap=True)
                assert (g - swapped[-rows:]).abs().max().item() > 1e-2
            draft = int(head.greedy_tokens(g[-1:])[0])
            ref_logits = ref[-1] @ target.embed_tokens.t()  # the target's (tied) LM head, no final norm
            assert draft == int(ref_logits.argmax())
            assert torch.allclose(head.compute_logits(g[-1:])[0], ref_logits, atol=1e-3)
            tokens, feats = tokens + [draft], torch.cat([feats, g[-1:]])  # the draft's own g as the next feature
            g = head.forward(torch.tensor([draft]), g[-1:], torch.tensor([len(tokens) - 1]),
                             kv.meta([(len(tokens) - 1, 1)]), kv.cache)


def test_eagle_kv_refresh_with_true_features_equals_fresh_computation(tmp_path, backend):
    """Slots written from draft-made features are rewritten with the target's true features after
    verification; the next step must equal a fresh computation over true features only."""
    hf, target = llama_target(num_layers=2)
    head = EagleHead(load_drafter_checkpoint(write_eagle(str(tmp_path), hf.config).folder), target)
    prompt = torch.randint(0, 160, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    n = len(prompt)
    hidden, _ = target_pass(target, prompt)
    x_n = int(target.greedy_tokens(hidden[-1:])[0])
    kv = DraftKV(head, [[3, 8, 1, 5, 0]])
    with torch.inference_mode():
        g = head.forward(torch.tensor(prompt[1:] + [x_n]), hidden, torch.arange(n), kv.meta([(0, n)]), kv.cache)
        drafts = [int(head.greedy_tokens(g[-1:])[0])]
        for j in range(2):  # two draft steps write positions n, n + 1 from draft-made features
            g = head.forward(torch.tensor([drafts[-1]]), g[-1:], torch.tensor([n + j]), kv.meta([(n + j, 1)]),
                             kv.cache)
            drafts.append(int(head.greedy_tokens(g)[0]))
        # Verification accepts drafts[0]; the target's own token y follows. True features f_n, f_{n+1}:
        seq = prompt + [x_n, drafts[0]]
        true_hidden, _ = target_pass(target, seq)
        y = int(target.greedy_tokens(true_hidden[-1:])[0])
        refresh_tokens = torch.tensor([drafts[0], y])  # pairs (f_n, x_{n+1}), (f_{n+1}, y)
        stale_cache = (kv.cache[0].clone(), kv.cache[1].clone())  # clone keeps the key layout's strides
        stale = head.forward(refresh_tokens[1:], true_hidden[n + 1:], torch.tensor([n + 1]), kv.meta([(n + 1, 1)]),
                             stale_cache)
        refreshed = head.forward(refresh_tokens, true_hidden[n:], torch.arange(n, n + 2), kv.meta([(n, 2)]),
                                 kv.cache)
        fresh_kv = DraftKV(head, [[0, 1, 2, 3]])
        fresh = head.forward(torch.tensor(seq[1:] + [y]), true_hidden, torch.arange(n + 2),
                             fresh_kv.meta([(0, n + 2)]), fresh_kv.cache)
    assert (refreshed - fresh[n:]).abs().max().item() < TOL
    # Without the refresh, slot n still holds the draft-made pair and the result differs.
    assert (stale[0] - fresh[n + 1]).abs().max().item() > 1e-3


def test_eagle_batched_requests_match_one_at_a_time(tmp_path, backend):
    """Two requests in one flattened batch, each on its own blocks, equal the reference per request."""
    hf, target = llama_target(num_layers=2)
    written = write_eagle(str(tmp_path), hf.config, fc_bias=False)
    head = EagleHead(load_drafter_checkpoint(written.folder, "eagle"), target)
    t = target_fields(hf.config)
    g_ = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 160, (n,), generator=g_).tolist() for n in (7, 13)]
    feats = [target_pass(target, p)[0] for p in prompts]
    kv = DraftKV(head, [[5, 1], [2, 7, 0, 3]])
    with torch.inference_mode():
        g = head.forward(torch.tensor(prompts[0] + prompts[1]), torch.cat(feats), torch.cat(
            [torch.arange(7), torch.arange(13)]), kv.meta([(0, 7), (0, 13)]), kv.cache)
    for (start, end), prompt, f in zip([(0, 7), (7, 20)], prompts, feats):
        cos, sin = ref_cos_sin(torch.arange(len(prompt)), t["head_dim"], t["rope_theta"])
        ref = ref_eagle1(written, t, target.embed_tokens, torch.tensor(prompt), f, cos, sin)
        assert (g[start:end] - ref).abs().max().item() < TOL


# ---------------------------------------------------------------- EAGLE-3


@pytest.mark.parametrize("layout", ["official", "sglang", "speculators"])
def test_eagle3_aux_states_draft_steps_and_d2t_match_reference(tmp_path, backend, layout):
    """Target aux states (inputs of layers 2, L//2, L-3 = HF hidden_states[i]) -> fc -> draft steps -> d2t."""
    hf = tiny_hf_model("llama", tie=True, num_hidden_layers=8, initializer_range=0.1)
    written = write_eagle3(str(tmp_path), hf.config, layout=layout, draft_vocab_size=48)
    ckpt = load_drafter_checkpoint(written.folder, "eagle3")
    aux_ids = ckpt.aux_layers_for(8)
    assert aux_ids == (2, 4, 5)
    target = build_model(hf_config_dict(hf), hf_state_dict(hf), dtype=torch.float32, aux_hidden_layers=aux_ids)
    head = Eagle3Head(ckpt, target)
    assert head.norm_before_residual == (layout == "speculators")
    t = {**target_fields(hf.config), "hidden_size": head.hidden_size}
    prompt = torch.randint(0, 160, (10,), generator=torch.Generator().manual_seed(6)).tolist()
    n = len(prompt)
    _, aux = target_pass(target, prompt)
    with torch.no_grad():
        hf_states = hf(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states
    ref_aux = torch.cat([hf_states[i][0] for i in aux_ids], -1)  # the residual stream entering layer i
    wrong_aux = torch.cat([hf_states[i + 1][0] for i in aux_ids], -1)  # a layer's output instead
    assert (torch.cat(aux, -1) - ref_aux).abs().max().item() < 1e-4
    fc = written.tensor("fc.weight")
    kv = DraftKV(head, [[4, 9, 1, 6, 2]])
    tokens = prompt[1:] + [int(target.greedy_tokens(target_pass(target, prompt)[0][-1:])[0])]
    hidden_in = ref_aux @ fc.t()
    nbr = layout == "speculators"
    with torch.inference_mode():
        g = head.forward(torch.tensor(tokens), head.project_aux(aux), torch.arange(n), kv.meta([(0, n)]), kv.cache)
        for step in range(4):
            cos, sin = ref_cos_sin(torch.arange(len(tokens)), t["head_dim"], t["rope_theta"])
            ref = ref_eagle3(written, t, target.embed_tokens, torch.tensor(tokens), hidden_in, cos, sin, nbr)
            rows = g.shape[0]
            assert (g - ref[-rows:]).abs().max().item() < TOL, step
            if step == 0:  # each of these mistakes moves the result
                for wrong in (dict(swap=True), dict(skip_hidden_norm=True), dict(norm_before_residual=not nbr)):
                    bad = ref_eagle3(written, t, target.embed_tokens, torch.tensor(tokens), hidden_in, cos, sin,
                                     **{"norm_before_residual": nbr, **wrong})
                    assert (g - bad).abs().max().item() > 1e-2, wrong
                bad_aux = ref_eagle3(written, t, target.embed_tokens, torch.tensor(tokens), wrong_aux @ fc.t(), cos,
                                     sin, nbr)
                assert (g - bad_aux).abs().max().item() > 1e-2
            ref_logits = ref_eagle3_logits(written, t, ref[-1:])
            assert torch.allclose(head.compute_logits(g[-1:]), ref_logits, atol=1e-3)
            draft = int(head.greedy_tokens(g[-1:])[0])
            assert draft == int(eagle3_target_ids(written, ref_logits.argmax(-1))[0])
            tokens, hidden_in = tokens + [draft], torch.cat([hidden_in, ref[-1:]])  # g fed back, no fc
            g = head.forward(torch.tensor([draft]), g[-1:], torch.tensor([len(tokens) - 1]),
                             kv.meta([(len(tokens) - 1, 1)]), kv.cache)


def test_eagle3_d2t_maps_draft_ids_and_scatters_logits(tmp_path):
    hf, target = llama_target(num_layers=8, aux=(2, 4, 5))
    written = write_eagle3(str(tmp_path), hf.config, draft_vocab_size=40, seed=2)
    head = Eagle3Head(load_drafter_checkpoint(written.folder), target)
    vocab_ids = torch.arange(40) + written.tensor("d2t")
    assert torch.equal(head.draft_to_target(torch.arange(40)), vocab_ids)
    assert not torch.equal(vocab_ids, torch.arange(40))  # a real remapping, not the identity
    g = torch.randn(6, head.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        draft_logits = head.compute_logits(g)
        full = head.logits_in_target_vocab(g)
        greedy = head.greedy_tokens(g)
    assert draft_logits.shape == (6, 40) and full.shape == (6, 160)
    assert torch.equal(full[:, vocab_ids], draft_logits)
    outside = torch.ones(160, dtype=torch.bool).index_fill_(0, vocab_ids, False)
    assert torch.isneginf(full[:, outside]).all()
    assert torch.equal(greedy, vocab_ids[draft_logits.argmax(-1)])
    assert torch.equal(greedy, full.argmax(-1))
    assert torch.allclose(full.softmax(-1)[:, vocab_ids], draft_logits.softmax(-1), atol=1e-6)


def test_eagle3_explicit_aux_ids_and_draft_hidden_size(tmp_path, backend):
    """eagle_config ids are used as given, in their order; a draft narrower than the target (H != Ht) brings
    its own embedding."""
    hf, _ = llama_target(num_layers=8)
    embed = torch.randn(160, 48, generator=torch.Generator().manual_seed(2))
    written = write_eagle3(str(tmp_path), hf.config, hidden_size=48, aux_layer_ids=[6, 1, 3], embed_tokens=embed)
    ckpt = load_drafter_checkpoint(written.folder)
    assert ckpt.aux_layers_for(8) == (6, 1, 3)
    target = build_model(hf_config_dict(hf), hf_state_dict(hf), dtype=torch.float32, aux_hidden_layers=(6, 1, 3))
    head = Eagle3Head(ckpt, target)
    assert head.aux_layer_ids == (6, 1, 3) and head.hidden_size == 48 and head.kv_cache_shape(3, 4) == (3, 4, 2, 16)
    prompt = list(range(5, 14))
    _, aux = target_pass(target, prompt)
    with torch.no_grad():
        hf_states = hf(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states
    ref_aux = torch.cat([hf_states[i][0] for i in (6, 1, 3)], -1)
    t = {**target_fields(hf.config), "hidden_size": 48}
    kv = DraftKV(head, [[2, 0, 1]])
    tokens = torch.arange(6, 15)
    with torch.inference_mode():
        g = head.forward(tokens, head.target_features(None, aux), torch.arange(9), kv.meta([(0, 9)]), kv.cache)
    cos, sin = ref_cos_sin(torch.arange(9), t["head_dim"], t["rope_theta"])
    ref = ref_eagle3(written, t, embed, tokens, ref_aux @ written.tensor("fc.weight").t(), cos, sin)
    assert g.shape == (9, 48) and (g - ref).abs().max().item() < TOL
    sorted_aux = torch.cat([hf_states[i][0] for i in (1, 3, 6)], -1)
    assert (g - ref_eagle3(written, t, embed, tokens, sorted_aux @ written.tensor("fc.weight").t(), cos, sin)
            ).abs().max().item() > 1e-2


# ---------------------------------------------------------------- M-RoPE targets


TEXT = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, initializer_range=0.2)
VISION = dict(depth=1, embed_dim=16, hidden_size=64, num_heads=2, mlp_ratio=1, patch_size=14, spatial_merge_size=2,
              temporal_patch_size=2)


def qwen2_vl_target():
    import copy

    import transformers

    torch.manual_seed(1234)
    config = transformers.Qwen2VLConfig(text_config=copy.deepcopy(TEXT), vision_config=copy.deepcopy(VISION),
                                        image_token_id=150, video_token_id=151, vision_start_token_id=152,
                                        vision_end_token_id=153)
    hf = transformers.Qwen2VLForConditionalGeneration(config).eval().float()
    model = build_model(hf_config_dict(hf), hf_state_dict(hf), dtype=torch.float32)
    assert model.uses_mrope
    return hf, model


@pytest.mark.parametrize("family", ["eagle", "eagle3"])
def test_mrope_target_positions_reach_the_head(tmp_path, backend, family):
    """[3, T] positions with distinct rows rotate by the target's M-RoPE sections; 1-row positions differ."""
    hf, target = qwen2_vl_target()
    t = target_fields(hf.config)
    if family == "eagle":
        written = write_eagle(str(tmp_path), hf.config, qkv_bias=True)  # a Qwen2-style layer: q/k/v biases
        head = EagleHead(load_drafter_checkpoint(written.folder, "eagle"), target)
    else:
        written = write_eagle3(str(tmp_path), hf.config, aux_layer_ids=[0, 1, 2], draft_vocab_size=64)
        head = Eagle3Head(load_drafter_checkpoint(written.folder, "eagle3"), target)
    assert head.rotary is target.rotary  # same theta and head size: the target's own M-RoPE
    T = 14
    positions = torch.stack([torch.arange(T), torch.arange(T) * 3 % 11, torch.arange(T) * 5 % 13 + 20])
    tokens = torch.randint(0, 150, (T,), generator=torch.Generator().manual_seed(8))
    features = torch.randn(T, 64, generator=torch.Generator().manual_seed(9))
    kv = DraftKV(head, [[3, 0, 2, 1]])
    with torch.inference_mode():
        g3 = head.forward(tokens, features, positions, kv.meta([(0, T)]), kv.cache)
        g1 = head.forward(tokens, features, positions[0], kv.meta([(0, T)]), kv.cache)
        g_equal_rows = head.forward(tokens, features, positions[0].expand(3, -1), kv.meta([(0, T)]), kv.cache)
    cos, sin = ref_cos_sin(positions, t["head_dim"], t["rope_theta"], [2, 3, 3])
    reference = ref_eagle1 if family == "eagle" else ref_eagle3
    ref = reference(written, t, target.embed_tokens, tokens, features, cos, sin)
    assert (g3 - ref).abs().max().item() < TOL
    assert (g3 - g1).abs().max().item() > 1e-2
    assert (g1 - g_equal_rows).abs().max().item() < 1e-6


def test_one_row_positions_only_for_non_mrope_targets(tmp_path):
    hf, target = llama_target(num_layers=2)
    head = EagleHead(load_drafter_checkpoint(write_eagle(str(tmp_path), hf.config).folder), target)
    kv = DraftKV(head, [[0]])
    with pytest.raises(ValueError, match=r"\[3, N\] positions need an M-RoPE target"):
        head.forward(torch.arange(3), torch.zeros(3, 64), torch.zeros(3, 3, dtype=torch.long), kv.meta([(0, 3)]),
                     kv.cache)


# ---------------------------------------------------------------- settings and options


def test_rope_theta_comes_from_the_draft_config(tmp_path):
    """EAGLE-1 configs copy the target's rope_theta; an EAGLE-3 config without one means 10000, not the target's."""
    import json

    from specserve.models.rope import RotaryEmbedding

    hf = tiny_hf_model("llama", tie=True, num_hidden_layers=8, rope_theta=5e5)
    target = build_model(hf_config_dict(hf), hf_state_dict(hf), dtype=torch.float32, aux_hidden_layers=(2, 4, 5))
    eagle = EagleHead(load_drafter_checkpoint(write_eagle(str(tmp_path / "e"), hf.config).folder), target)
    written = write_eagle3(str(tmp_path / "e3"), hf.config)
    config_file = tmp_path / "e3" / "config.json"
    config = json.loads(config_file.read_text())
    config.pop("rope_theta")
    config_file.write_text(json.dumps(config))
    eagle3 = Eagle3Head(load_drafter_checkpoint(written.folder), target)
    assert eagle.rotary is target.rotary and eagle3.rotary is not target.rotary
    for head, theta in ((eagle, 5e5), (eagle3, 10000.0)):
        expected = RotaryEmbedding(16, 256, theta, None)
        assert torch.equal(head.rotary.cos[:256], expected.cos) and torch.equal(head.rotary.sin[:256], expected.sin)


@pytest.mark.parametrize("family", ["eagle", "eagle3"])
@pytest.mark.parametrize("weight_dtype", ["int8", "q4"])
def test_quantized_draft_weights_stay_close(tmp_path, family, weight_dtype):
    hf, target = llama_target(num_layers=8, aux=(2, 4, 5))
    write, cls = (write_eagle, EagleHead) if family == "eagle" else (write_eagle3, Eagle3Head)
    ckpt = load_drafter_checkpoint(write(str(tmp_path), hf.config).folder)
    exact, approx = cls(ckpt, target), cls(ckpt, target, weight_dtype=weight_dtype)
    features = torch.randn(12, 64, generator=torch.Generator().manual_seed(3))
    tokens = torch.arange(20, 32)
    outs = []
    for head in (exact, approx):
        kv = DraftKV(head, [[1, 0, 2]])
        with torch.inference_mode():
            outs.append(head.forward(tokens, features, torch.arange(12), kv.meta([(0, 12)]), kv.cache))
    # 4-bit groups of random normal weights: a step of ~0.4 sigma (tests/models/test_gguf_quant.py checks
    # the grid itself); int8 per channel: ~0.02 sigma
    bound = 0.25 if weight_dtype == "q4" else 0.05
    assert (outs[0] - outs[1]).abs().max().item() < bound * outs[0].abs().max().item()


def c_head_on_blocks(tmp_path, layout: str, weight_dtype, seed: int):
    """A random EAGLE-3 head on a tiny target, three requests' scattered blocks and prompts of 5, 9 and 14
    tokens: (target, head, tables, DraftKV, prompts); skips where the C kernels are off."""
    hf, target = llama_target(num_layers=8, aux=(2, 4, 5))
    ckpt = load_drafter_checkpoint(write_eagle3(str(tmp_path), hf.config, layout=layout, draft_vocab_size=48).folder)
    head = Eagle3Head(ckpt, target, weight_dtype=weight_dtype)
    tables = [[3, 11, 6, 0], [9, 2, 14, 5, 1], [7, 12, 4, 13, 8, 10]]
    kv = DraftKV(head, tables)
    if head.chains_kernel(kv.cache) is None:
        pytest.skip("the C kernels are off")
    g_ = torch.Generator().manual_seed(seed)
    return target, head, tables, kv, [torch.randint(0, 160, (n,), generator=g_).tolist() for n in (5, 9, 14)]


@pytest.mark.parametrize("layout, weight_dtype, num_drafts", [("official", None, [1, 3, 5]),
                                                              ("speculators", None, [4, 2, 3]),
                                                              ("official", "int8", [1, 3, 5]),
                                                              ("official", "q4", [1, 1, 1])])
def test_eagle3_c_chains_equal_the_step_by_step_drafts(tmp_path, layout, weight_dtype, num_drafts):
    """draft_chains (one C call) against greedy_tokens + forward a step at a time from Python, three requests
    drafting different numbers of tokens on scattered blocks: the same drafts, and bitwise the same K/V in every
    slot."""
    target, head, tables, kv, prompts = c_head_on_blocks(tmp_path, layout, weight_dtype, seed=11)
    with torch.inference_mode():
        aux = [target_pass(target, p)[1] for p in prompts]
        feats = torch.cat([head.project_aux(a) for a in aux])
        g = head.forward(torch.tensor([t for p in prompts for t in p]), feats,
                         torch.cat([torch.arange(len(p)) for p in prompts]), kv.meta([(0, len(p)) for p in prompts]),
                         kv.cache)
        ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        first = g[ends]
        caches = [tuple(c.clone() for c in kv.cache) for _ in range(2)]
        history = [len(p) + 1 for p in prompts]  # the prompt and the token the target verified
        c_drafts = head.draft_chains(head.chains_kernel(caches[0]), first, num_drafts, [len(p) for p in prompts],
                                     history, tables, BLOCK_SIZE)
        kv.cache = caches[1]
        head.chains_kernel = lambda kv_cache: None  # the reference: a step at a time, each op from Python
        py_drafts, live, state = [[] for _ in prompts], [0, 1, 2], first
        for step in range(max(num_drafts)):
            for j, d in zip(live, head.greedy_tokens(state).tolist()):
                py_drafts[j].append(d)
            keep = [k for k, j in enumerate(live) if len(py_drafts[j]) < num_drafts[j]]
            live = [live[k] for k in keep]
            if not live:
                break
            index = [history[j] - 1 + step for j in live]
            slots = [tables[j][i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE for j, i in zip(live, index)]
            meta = build_attention_metadata([1] * len(live), [i + 1 for i in index], [tables[j] for j in live],
                                            BLOCK_SIZE, torch.tensor(slots), True)
            state = head.forward(torch.tensor([py_drafts[j][-1] for j in live]), state[keep],
                                 torch.tensor([len(prompts[j]) + step for j in live]), meta, kv.cache)
    assert c_drafts == py_drafts and [len(d) for d in c_drafts] == num_drafts
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert not torch.equal(caches[0][0], kv_caches(head.kv_cache_shape(15, BLOCK_SIZE), torch.float32, 1)[0][0])


@pytest.mark.parametrize("layout", ["official", "speculators"])
def test_eagle3_c_forward_is_bitwise_the_python_forward(tmp_path, layout):
    """Eagle3Head.forward in one C call against the same forward op by op from Python: prompts of three requests
    in one batch (multi-row queries), then one row each, g and the K/V written bitwise equal."""
    target, head, tables, kv, prompts = c_head_on_blocks(tmp_path, layout, None, seed=12)
    g_ = torch.Generator().manual_seed(13)
    hidden = torch.randn(sum(map(len, prompts)), head.hidden_size, generator=g_)
    tokens = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    fresh = tuple(c.clone() for c in kv.cache)
    results = []
    for use_c in (True, False):
        if not use_c:
            head.chains_kernel = lambda kv_cache: None
        kv.cache = tuple(c.clone() for c in fresh)
        with torch.inference_mode():
            g = head.forward(tokens, hidden, positions, kv.meta([(0, len(p)) for p in prompts]), kv.cache)
            one = head.forward(torch.tensor([1, 2, 3]), g[:3], torch.tensor([len(p) for p in prompts]),
                               kv.meta([(len(p), 1) for p in prompts]), kv.cache)
        results.append((g, one, kv.cache))
    (g_c, one_c, cache_c), (g_py, one_py, cache_py) = results
    assert torch.equal(g_c, g_py) and torch.equal(one_c, one_py)
    assert torch.equal(cache_c[0], cache_py[0]) and torch.equal(cache_c[1], cache_py[1])
