"""EAGLE-1/2 and EAGLE-3 draft heads: one decoder layer over [token embedding; feature] with its own paged KV.

Built from a loaded checkpoint (drafter_loader.py) and the target model, whose embedding, rotary rule
(M-RoPE included) and, for EAGLE-1, LM head they share. The proposer owns the KV cache and the rounds.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from specserve.models.drafter_loader import DrafterCheckpoint, cast_weight, expect_tensor, to_target_vocab
from specserve.models.llama import DecoderConfig, make_linear, rms_norm
from specserve.models.loader import ModelLoadError
from specserve.models.qwen2_vl import MRotaryEmbedding
from specserve.models.rope import RotaryEmbedding, apply_rotary
from specserve.ops import fused, kernels
from specserve.ops.attention import AttentionMetadata, paged_attention
from specserve.ops.kv_cache import KV_CODES

KVCache = tuple[torch.Tensor, torch.Tensor]  # one layer's (key, value) caches, see attention.kv_caches


class _DraftLayer:
    """The head's decoder layer `layers.0.*` without an input norm: attention over `in_features`-wide inputs
    (H for EAGLE-1, 2H for EAGLE-3) with a given residual, then post-attention norm and MLP, residual added."""

    def __init__(self, cfg: DecoderConfig, ckpt: DrafterCheckpoint, in_features: int, dtype: torch.dtype,
                 weight_dtype, c_ops: bool) -> None:
        H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        self.cfg, self.c_ops = cfg, c_ops
        self.q_size, self.kv_size = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
        self.scale = D ** -0.5
        self.window = 0  # the target's KV window, when its cache manager frees blocks before it
        attn = "layers.0.self_attn."
        why = f"[heads x head_dim, {in_features}], heads and head_dim from config.json"
        weights = [expect_tensor(ckpt, attn + "q_proj.weight", (self.q_size, in_features), why),
                   expect_tensor(ckpt, attn + "k_proj.weight", (self.kv_size, in_features), why),
                   expect_tensor(ckpt, attn + "v_proj.weight", (self.kv_size, in_features), why)]
        self.qkv = make_linear(cast_weight(torch.cat(weights), dtype), cast_weight(self._qkv_bias(ckpt), dtype), weight_dtype)
        o_bias = ckpt.state_dict.get(attn + "o_proj.bias")
        self.o_proj = make_linear(cast_weight(expect_tensor(ckpt, attn + "o_proj.weight", (H, self.q_size)), dtype),
                                  cast_weight(o_bias, dtype), weight_dtype)
        gate = expect_tensor(ckpt, "layers.0.mlp.gate_proj.weight", (I, H), "intermediate_size x hidden_size")
        up = expect_tensor(ckpt, "layers.0.mlp.up_proj.weight", (I, H), "intermediate_size x hidden_size")
        self.gate_up = make_linear(cast_weight(torch.cat([gate, up]), dtype), None, weight_dtype)
        self.down = make_linear(cast_weight(expect_tensor(ckpt, "layers.0.mlp.down_proj.weight", (H, I)), dtype), None,
                                weight_dtype)
        self.post_norm = cast_weight(expect_tensor(ckpt, "layers.0.post_attention_layernorm.weight", (H,)), dtype)

    def _qkv_bias(self, ckpt: DrafterCheckpoint) -> torch.Tensor | None:
        names = [f"layers.0.self_attn.{p}_proj.bias" for p in "qkv"]
        present = [n for n in names if n in ckpt.state_dict]
        if not present:
            return None
        sizes = (self.q_size, self.kv_size, self.kv_size)
        return torch.cat([expect_tensor(ckpt, n, (size,), "q, k and v biases come together")
                          for n, size in zip(names, sizes)])

    def forward(self, x: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """x: [N, in_features] attention input; residual: [N, H] -> [N, H] (MLP output + residual)."""
        cfg, n = self.cfg, x.shape[0]
        qkv = self.qkv(x)
        if self.c_ops:
            kernels.rope_qk(qkv, cos.reshape(n, -1), sin.reshape(n, -1),
                            cfg.num_attention_heads + cfg.num_key_value_heads, cfg.head_dim)
        q = qkv[:, : self.q_size].view(n, cfg.num_attention_heads, cfg.head_dim)
        k = qkv[:, self.q_size: self.q_size + self.kv_size].view(n, cfg.num_key_value_heads, cfg.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(n, cfg.num_key_value_heads, cfg.head_dim)
        if not self.c_ops:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attn = paged_attention(q, k, v.contiguous(), kv_cache[0], kv_cache[1], meta, self.scale, self.window)
        residual = self.o_proj(attn) + residual  # a new tensor: the caller's residual is left as it was
        if self.c_ops:
            h = kernels.add_rms_norm(None, residual, self.post_norm, cfg.rms_norm_eps)
            return self.down(kernels.silu_mul(self.gate_up(h))) + residual
        gate_up = self.gate_up(rms_norm(residual, self.post_norm, cfg.rms_norm_eps))
        inter = gate_up.shape[-1] // 2
        return self.down(F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) + residual


class _EagleHeadBase:
    """What both EAGLE heads share: the config, the layer's rotary rule and its one-layer KV cache."""

    num_layers = 1

    def __init__(self, ckpt: DrafterCheckpoint, target, family: str) -> None:
        if ckpt.family != family:
            raise ValueError(f"{type(self).__name__} needs a {family!r} checkpoint, got {ckpt.family!r}")
        self.config = _draft_config(ckpt)
        self.dtype = target.dtype
        self.c_ops = kernels.kernel_usable(self.dtype)
        self.uses_mrope = target.uses_mrope
        self.rotary = _draft_rotary(self.config, target, ckpt.source)
        self.target_hidden_size = target.config.hidden_size
        self.hidden_size = self.config.hidden_size
        self.vocab_size = target.config.vocab_size

    def _check_config(self, ckpt: DrafterCheckpoint) -> None:
        """After the tensors (whose errors name shapes): the config's sizes against the target's."""
        if self.config.vocab_size != self.vocab_size:
            raise ModelLoadError(f"{ckpt.source}: config.json vocab_size {self.config.vocab_size} differs from the "
                                 f"target's vocabulary of {self.vocab_size} tokens: a draft for another model")

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """Shape of each of the layer's key and value caches, as attention.kv_caches takes it."""
        return (num_blocks, block_size, self.config.num_key_value_heads, self.config.head_dim)

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [N], or [3, N] when the target uses M-RoPE (the positions the target saw)."""
        if positions.dim() == 2 and not self.uses_mrope:
            raise ValueError(f"positions of shape {list(positions.shape)}: [3, N] positions need an M-RoPE target")
        return self.rotary.cos_sin(positions)

    def _check_width(self, name: str, tensor: torch.Tensor, width: int) -> None:
        if tensor.dim() != 2 or tensor.shape[1] != width:
            raise ValueError(f"{name} must be [N, {width}], got {list(tensor.shape)}")


class EagleHead(_EagleHeadBase):
    """EAGLE-1/2: g = layer(fc(cat(embed(x_{p+1}), f_p))), with no input norm and no final norm; the
    target's own LM head turns g into logits over the target vocabulary.

    f_p is the target's final post-norm hidden state at position p for target-verified positions, and the
    head's own previous output g for positions it drafted.
    """

    aux_layer_ids: tuple[int, ...] = ()  # reads the target's final states only

    def __init__(self, checkpoint: DrafterCheckpoint, target, weight_dtype=None) -> None:
        super().__init__(checkpoint, target, "eagle")
        H = self.target_hidden_size
        why = f"EAGLE-1: [H, 2H] with the target's hidden size H = {H}"
        fc = expect_tensor(checkpoint, "fc.weight", (H, 2 * H), why)
        fc_bias = checkpoint.state_dict.get("fc.bias")
        if fc_bias is not None:
            expect_tensor(checkpoint, "fc.bias", (H,), why)
        if self.hidden_size != H:
            raise ModelLoadError(f"{checkpoint.source}: config.json hidden_size {self.hidden_size} differs from the "
                                 f"target's {H}")
        norms = [n for n in ("layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight", "norm.weight")
                 if n in checkpoint.state_dict]
        if norms:
            raise ModelLoadError(f"{checkpoint.source}: unexpected tensor(s) {norms}: an EAGLE-1 layer has no input "
                                 f"norm and the head no final norm")
        self.fc = make_linear(cast_weight(fc, self.dtype), cast_weight(fc_bias, self.dtype), weight_dtype)
        self.embed_tokens = _draft_embedding(checkpoint, target, H)
        self.layer = _DraftLayer(self.config, checkpoint, H, self.dtype, weight_dtype, self.c_ops)
        self.target = target
        self._check_config(checkpoint)

    def target_features(self, target_hidden: torch.Tensor, aux_hidden: object = None) -> torch.Tensor:
        """target_hidden: [T, H] the target's final post-norm states -> the head's features [T, H] (as is)."""
        return target_hidden

    def forward(self, token_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        """token_ids: [N] (x_{p+1}); features: [N, H] (f_p); positions: [N] or [3, N] (p); meta: attention
        metadata over the head's own block tables; writes the N tokens' K/V at meta.slot_mapping into
        kv_cache (attention.kv_caches(self.kv_cache_shape(...), dtype, 1)[0]); returns g: [N, H]."""
        self._check_width("features", features, self.hidden_size)
        u = self.fc(torch.cat([self.embed_tokens[token_ids], features], dim=-1))
        cos, sin = self._cos_sin(positions)
        return self.layer.forward(u, u, cos, sin, kv_cache, meta)

    def compute_logits(self, g: torch.Tensor) -> torch.Tensor:
        """g: [M, H] -> [M, V] float32 logits over the target vocabulary (the target's LM head)."""
        return self.target.compute_logits(g)

    logits_in_target_vocab = compute_logits

    def greedy_tokens(self, g: torch.Tensor) -> torch.Tensor:
        """g: [M, H] -> [M] int64 target token ids, argmax of compute_logits(g)."""
        return self.target.greedy_tokens(g)

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids  # the draft predicts over the target vocabulary


class Eagle3Head(_EagleHeadBase):
    """EAGLE-3: fuses three target layers' states and predicts over its own (smaller) vocabulary.

    One step at position p, with h_p = fc(cat(aux_low, aux_mid, aux_high)) for target-verified positions
    (`project_aux`) and the head's own previous pre-norm output g for drafted ones:
        z = cat(input_layernorm(embed(x_{p+1})), hidden_norm(h_p))            # [2H], embedding first
        r = h_p (hidden_norm(h_p) when norm_before_residual) + o_proj(attn(z))
        g = r + mlp(post_attention_layernorm(r))                              # pre-norm output
        logits over Vd = lm_head(norm(g)); target id = draft id + d2t[draft id]
    """

    def __init__(self, checkpoint: DrafterCheckpoint, target, weight_dtype=None) -> None:
        super().__init__(checkpoint, target, "eagle3")
        H, Ht, V = self.hidden_size, self.target_hidden_size, self.vocab_size
        declared = checkpoint.config.get("target_hidden_size")
        if declared is not None and declared != Ht:
            raise ModelLoadError(f"{checkpoint.source}: config.json target_hidden_size {declared} differs from the "
                                 f"target's hidden size {Ht}")
        self.aux_layer_ids = checkpoint.aux_layers_for(target.config.num_hidden_layers)
        fc = expect_tensor(checkpoint, "fc.weight", (H, 3 * Ht),
                           f"EAGLE-3: [H, 3 * Ht], draft hidden size H = {H}, target hidden size Ht = {Ht}")
        fc_bias = checkpoint.state_dict.get("fc.bias")
        if fc_bias is not None:
            expect_tensor(checkpoint, "fc.bias", (H,))
        self.fc = make_linear(cast_weight(fc, self.dtype), cast_weight(fc_bias, self.dtype), weight_dtype)
        self.embed_tokens = _draft_embedding(checkpoint, target, H)
        self.input_norm = cast_weight(expect_tensor(checkpoint, "layers.0.input_layernorm.weight", (H,)), self.dtype)
        self.hidden_norm = cast_weight(expect_tensor(checkpoint, "layers.0.hidden_norm.weight", (H,)), self.dtype)
        self.norm = cast_weight(expect_tensor(checkpoint, "norm.weight", (H,)), self.dtype)
        self.norm_before_residual = checkpoint.norm_before_residual
        self.layer = _DraftLayer(self.config, checkpoint, 2 * H, self.dtype, weight_dtype, self.c_ops)
        self.draft_vocab_size = Vd = checkpoint.draft_vocab_size
        self.lm_head = self._lm_head(checkpoint, target, weight_dtype)
        self.exact_argmax = getattr(self.lm_head, "enable_exact_argmax", lambda: False)()
        self.draft_ids = _draft_id_map(checkpoint, Vd, V)  # [Vd] target id of each draft id; None: identity
        self._chains = fused.TensorKeyed(self._build_chains_kernel)
        self._check_config(checkpoint)

    def _lm_head(self, ckpt: DrafterCheckpoint, target, weight_dtype):
        Vd, H = self.draft_vocab_size, self.hidden_size
        if "lm_head.weight" in ckpt.state_dict or Vd != self.vocab_size or H != self.target_hidden_size:
            weight = expect_tensor(ckpt, "lm_head.weight", (Vd, H), f"draft_vocab_size {Vd} x hidden size {H}")
            return make_linear(cast_weight(weight, self.dtype), None, weight_dtype)
        return target.lm_head  # a full-vocabulary draft saved without a head of its own

    def project_aux(self, aux_hidden: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """aux_hidden: [T, 3 * Ht], or three [T, Ht] states of the layers `aux_layer_ids` in that order ->
        [T, H], the hidden input for target-verified positions."""
        if not isinstance(aux_hidden, torch.Tensor):
            if len(aux_hidden) != len(self.aux_layer_ids):
                raise ValueError(f"expected {len(self.aux_layer_ids)} aux hidden states (layers "
                                 f"{list(self.aux_layer_ids)}), got {len(aux_hidden)}")
            aux_hidden = torch.cat(list(aux_hidden), dim=-1)
        self._check_width("aux_hidden", aux_hidden, 3 * self.target_hidden_size)
        return self.fc(aux_hidden)

    def target_features(self, target_hidden: torch.Tensor | None, aux_hidden) -> torch.Tensor:
        """The head's hidden input [T, H] for target-verified positions: project_aux(aux_hidden)."""
        if aux_hidden is None:
            raise ValueError(f"EAGLE-3 reads the target's aux hidden states (inputs of layers "
                             f"{list(self.aux_layer_ids)}); the target was run without them")
        return self.project_aux(aux_hidden)

    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        """token_ids: [N] (x_{p+1}); hidden: [N, H] (project_aux output or a previous g); positions: [N] or
        [3, N]; writes the N tokens' K/V at meta.slot_mapping; returns g: [N, H] (pre-norm)."""
        self._check_width("hidden", hidden, self.hidden_size)
        kernel = self.chains_kernel(kv_cache) if meta.kernel is not None and positions.dim() == 1 else None
        if kernel is not None:  # the same kernels in one C call
            cos, sin = self._cos_sin(positions)
            cfg = self.config
            return fused.eagle3_forward(
                kernel, hidden.contiguous(), token_ids.to(torch.int64).contiguous(), cos.reshape(len(token_ids), -1),
                sin.reshape(len(token_ids), -1), meta.slot_mapping, meta.slot_rows, meta.kernel,
                (self.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                 cfg.intermediate_size), kv_cache[0].shape[1], cfg.rms_norm_eps, self.layer.scale)
        normed = self._norm(hidden, self.hidden_norm)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self._norm(self.embed_tokens[token_ids], self.input_norm), normed], dim=-1)
        cos, sin = self._cos_sin(positions)
        return self.layer.forward(x, residual, cos, sin, kv_cache, meta)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMS norm, on the C kernel where the head runs them (the one draft_chains calls, so both agree bitwise)."""
        if self.c_ops:
            return kernels.add_rms_norm(None, x.contiguous(), weight, self.config.rms_norm_eps)
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def compute_logits(self, g: torch.Tensor) -> torch.Tensor:
        """g: [M, H] -> [M, Vd] float32 logits over the draft vocabulary."""
        return self.lm_head(self._norm(g, self.norm)).float()

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [...] draft token ids -> the same shape of target token ids (d + d2t[d])."""
        return ids if self.draft_ids is None else self.draft_ids[ids]

    def greedy_tokens(self, g: torch.Tensor) -> torch.Tensor:
        """g: [M, H] -> [M] int64 target token ids: argmax over the draft vocabulary, mapped by d2t."""
        h = self._norm(g, self.norm)
        ids = self.lm_head.argmax(h) if self.exact_argmax else kernels.argmax_rows(self.lm_head(h).float())
        return self.draft_to_target(ids)

    def chains_kernel(self, kv_cache: KVCache) -> "fused.Eagle3C | None":
        """The C struct draft_chains runs on, or None where the head cannot run there: the C kernels off, M-RoPE
        (positions per section), or a linear or embedding outside the C GEMMs' formats."""
        if not self.c_ops or self.uses_mrope:
            return None
        return self._chains.get((kv_cache[0], kv_cache[1]))

    def _build_chains_kernel(self, caches: tuple) -> "fused.Eagle3C | None":
        from specserve.models.gguf_quant import QuantizedWeight

        layer = self.layer
        linears = [getattr(lin, "c_operands", lambda: None)()
                   for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down, self.lm_head)]
        embed = self.embed_tokens
        if any(op is None for op in linears) or not (
                isinstance(embed, QuantizedWeight) or (isinstance(embed, torch.Tensor) and embed.dtype == torch.float32
                                                       and embed.is_contiguous())):
            return None
        if isinstance(embed, QuantizedWeight):
            embed_ptr, (fmt, group), keep = embed.packed.data_ptr(), embed.weight_format, [embed.packed]
        else:
            embed_ptr, fmt, group, keep = embed.data_ptr(), -1, 0, [embed]
        screen = self.lm_head._screen if self.exact_argmax else None
        draft_ids = self.draft_ids.to(torch.int64).contiguous() if self.draft_ids is not None else None
        norms = [t.contiguous() for t in (self.input_norm, self.hidden_norm, layer.post_norm, self.norm)]
        struct = fused.Eagle3C(*(fused.linear_c(op) for op in linears), *(t.data_ptr() for t in norms), embed_ptr,
                                 fmt, group, *(t.data_ptr() for t in screen) if screen else (None,) * 4,
                                 draft_ids.data_ptr() if draft_ids is not None else None, caches[0].data_ptr(),
                                 caches[1].data_ptr(), layer.window, int(bool(self.norm_before_residual)),
                                 KV_CODES[caches[0].dtype])
        struct.keep = (linears, norms, keep, screen, draft_ids, caches)  # what the pointers point into
        return struct

    def draft_chains(self, kernel: "fused.Eagle3C", g0: torch.Tensor, num_drafts: list[int], positions: list[int],
                     history: list[int], block_tables: list[list[int]], block_size: int) -> list[list[int]]:
        """Greedy chains for R requests in one C call, each draft bitwise what greedy_tokens then forward give
        a step at a time. g0: [R, H] the outputs the first drafts come from; per request: its number of drafts,
        the position p and the history length n of its first draft (draft s is fed back at position p + s, its
        K/V at cache index n - 1 + s), and its block table."""
        R, steps = len(num_drafts), max(num_drafts) - 1
        width = max(len(t) for t in block_tables)
        slots, context, at = [], [], []
        for n, p, h, table in zip(num_drafts, positions, history, block_tables):
            for s in range(steps):  # lists: a handful of rows, cheaper than tensor arithmetic
                i = h - 1 + s
                slots.append(table[i // block_size] * block_size + i % block_size if s < n - 1 else 0)
                context.append(i + 1)
                at.append(p + s)
        cos, sin = self._cos_sin(torch.tensor(at, dtype=torch.int64))
        cfg = self.config
        dims = (self.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                cfg.intermediate_size, self.draft_vocab_size)
        out = fused.eagle3_chains(
            kernel, g0.contiguous(), torch.tensor(num_drafts, dtype=torch.int64),
            cos.reshape(R, steps, cfg.head_dim).contiguous(), sin.reshape(R, steps, cfg.head_dim).contiguous(),
            torch.tensor(slots, dtype=torch.int64).reshape(R, steps),
            torch.tensor(context, dtype=torch.int64).reshape(R, steps),
            torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int64), dims, block_size,
            cfg.rms_norm_eps, self.layer.scale)
        return [row[:n] for row, n in zip(out.tolist(), num_drafts)]

    def logits_in_target_vocab(self, g: torch.Tensor) -> torch.Tensor:
        """g: [M, H] -> [M, V] float32: the draft logits at their target ids, -inf elsewhere, so a softmax
        gives draft probabilities over the target vocabulary."""
        return to_target_vocab(self.compute_logits(g), self.draft_ids, self.vocab_size)


# ---------------------------------------------------------------- shared pieces


def _draft_config(ckpt: DrafterCheckpoint) -> DecoderConfig:
    raw = dict(ckpt.config)
    raw.setdefault("num_hidden_layers", 1)
    raw.pop("layer_types", None)  # a copy of the target's; the head attends over the target's KV window
    cfg = DecoderConfig.from_hf(raw)
    if cfg.hidden_act != "silu":
        raise ModelLoadError(f"{ckpt.source}: hidden_act {cfg.hidden_act!r} is not supported (supported: silu)")
    return cfg


def _draft_rotary(cfg: DecoderConfig, target, source: str) -> RotaryEmbedding:
    """The draft's RoPE: the draft config's rope_theta/scaling (10000 when it names none), over positions
    the target may reach; for an M-RoPE target with the target's sections, so the draft reads the same
    [3, N] positions the target saw. The target's own tables when the settings agree."""
    tc, mrope = target.config, target.uses_mrope
    max_position = max(cfg.max_position_embeddings, tc.max_position_embeddings)
    if (cfg.head_dim == tc.head_dim and cfg.rope_theta == tc.rope_theta and max_position <= target.rotary.max_position
            and (mrope or cfg.rope_scaling == tc.rope_scaling)):
        return target.rotary  # the same tables (M-RoPE carries no scaling)
    if not mrope:
        return RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, target.dtype)
    section = list(target.rotary.mrope_section)
    if sum(section) != cfg.head_dim // 2:
        raise ModelLoadError(f"{source}: draft head_dim {cfg.head_dim} does not fit the target's M-RoPE sections "
                             f"{section} (they must sum to head_dim / 2)")
    return MRotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, section, target.dtype)


def _draft_embedding(ckpt: DrafterCheckpoint, target, hidden: int) -> torch.Tensor:
    """[V, H]: the checkpoint's embed_tokens when it has one that differs from the target's, else the target's."""
    vocab, shared = target.config.vocab_size, target.embed_tokens
    if "embed_tokens.weight" not in ckpt.state_dict:
        if shared.shape[1] != hidden:
            raise ModelLoadError(f"{ckpt.source}: missing tensor 'embed_tokens.weight', expected shape "
                                 f"{[vocab, hidden]}: the target's embedding {list(shared.shape)} does not fit a "
                                 f"draft of hidden size {hidden}")
        return shared
    own = expect_tensor(ckpt, "embed_tokens.weight", (vocab, hidden),
                        f"the target's vocabulary {vocab} x the draft's hidden size {hidden}").to(target.dtype)
    same = isinstance(shared, torch.Tensor) and own.shape == shared.shape and torch.equal(own, shared)
    return shared if same else own.contiguous()


def _draft_id_map(ckpt: DrafterCheckpoint, draft_vocab: int, vocab: int) -> torch.Tensor | None:
    """[Vd] int64 target id of each draft id (d + d2t[d]); None when the draft vocabulary is the target's."""
    if "d2t" not in ckpt.state_dict:
        if draft_vocab != vocab:
            raise ModelLoadError(f"{ckpt.source}: missing tensor 'd2t', expected shape {[draft_vocab]}: a draft "
                                 f"vocabulary of {draft_vocab} tokens needs the map to the target's {vocab}")
        return None
    d2t = expect_tensor(ckpt, "d2t", (draft_vocab,), "one offset per draft token")
    ids = torch.arange(draft_vocab, dtype=torch.int64) + d2t.to(torch.int64)
    if draft_vocab and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ModelLoadError(f"{ckpt.source}: tensor 'd2t' maps draft ids to target ids in [{int(ids.min())}, "
                             f"{int(ids.max())}], outside the target's vocabulary of {vocab} tokens")
    return ids
