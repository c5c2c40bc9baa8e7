"""Reads EAGLE-1/2, EAGLE-3 and Medusa drafter checkpoints in the layouts their public releases use.

The family is detected from the tensors (and config), and names are mapped to one canonical set, so the
heads (models/eagle.py, models/medusa.py) read one format. Checks against the target run in the heads.

Canonical names:
    EAGLE-1 / EAGLE-3: fc.weight [H, 2H | 3Ht], fc.bias, embed_tokens.weight, layers.0.self_attn.{q,k,v,o}_proj.*,
        layers.0.mlp.{gate,up,down}_proj.weight, layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
        norm.weight, lm_head.weight [Vd, H], d2t [Vd] int64 (target id = draft id + d2t[draft id]).
    Medusa (vLLM's names): blocks.{i}.layers.{j}.weight/bias [H, H], lm_heads.{i}.weight [V, H], token_map.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specserve.models.loader import ModelLoadError, safetensors_files

DRAFTER_METHODS = ("eagle", "eagle3", "medusa")
_EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")
_MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
_TORCH_FILES = ("pytorch_model.bin", "medusa_lm_head.pt")
_LAYER_PARTS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias",
                "self_attn.v_proj.bias", "self_attn.o_proj.bias", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                "mlp.down_proj.weight", "input_layernorm.weight", "hidden_norm.weight",
                "post_attention_layernorm.weight")
_EAGLE_TOP = ("fc.weight", "fc.bias", "embed_tokens.weight", "norm.weight", "lm_head.weight", "d2t")
_FASTERDECODING_BLOCK = re.compile(r"^(\d+)\.(\d+)\.linear\.(weight|bias)$")
_FASTERDECODING_HEAD = re.compile(r"^(\d+)\.(\d+)\.(weight|bias)$")
_VLLM_BLOCK = re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")
_VLLM_HEAD = re.compile(r"^lm_heads\.(\d+)\.(weight|bias)$")


@dataclass
class DrafterCheckpoint:
    """A drafter checkpoint in canonical form (see the module docstring), not yet checked against a target.

    family: "eagle" (EAGLE-1/2), "eagle3" or "medusa".
    config: EAGLE: the draft layer's Llama fields (a speculators config's `transformer_layer_config`,
        flattened); Medusa: config.json as found ({} when absent).
    aux_layer_ids: EAGLE-3 only, the target layers whose INPUT is captured (HF `hidden_states[i]`, the
        unnormalized residual stream entering layer i), as given by `eagle_aux_hidden_state_layer_ids`;
        None means the default for the target, see `aux_layers_for`. This is vLLM's reading of those ids.
    norm_before_residual: EAGLE-3: the layer's residual is hidden_norm(h) instead of h (speculators).
    draft_vocab_size: EAGLE-3: Vd, the rows of lm_head.
    num_heads / num_layers: Medusa: K heads, and ResBlocks per head (read from the keys).
    ignored_keys: tensors present in the files that no head reads (t2d, Medusa-2 backbone, ...).
    """

    family: str
    config: dict
    state_dict: dict[str, torch.Tensor]
    source: str
    aux_layer_ids: tuple[int, ...] | None = None
    norm_before_residual: bool = False
    draft_vocab_size: int | None = None
    num_heads: int = 0
    num_layers: list[int] = field(default_factory=list)
    ignored_keys: list[str] = field(default_factory=list)
    file_names: dict[str, str] = field(default_factory=dict)  # canonical name -> the name in the file

    def aux_layers_for(self, num_target_layers: int) -> tuple[int, ...]:
        """EAGLE-3's three target layers, "input of layer i": the config's ids, else (2, L // 2, L - 3).

        The head concatenates the captured states in this order (the order the config lists them).
        """
        L = num_target_layers
        ids = self.aux_layer_ids if self.aux_layer_ids is not None else (2, L // 2, L - 3)
        if len(ids) != 3 or any(not 0 <= i < L for i in ids) or len(set(ids)) != 3:
            raise ModelLoadError(
                f"{self.source}: EAGLE-3 aux hidden state layers {list(ids)} do not fit a target of {L} layers "
                f"(need 3 distinct layer indices in [0, {L}))")
        return tuple(ids)


def load_drafter_checkpoint(path: str, method: str | None = None, dtype: torch.dtype = torch.float32
                            ) -> DrafterCheckpoint:
    """Read a drafter from PATH: a folder with config.json and *.safetensors / pytorch_model.bin /
    medusa_lm_head.{safetensors,pt}, or one such weight file (its folder's config.json is read if present).

    method: "eagle", "eagle3", "medusa", or None to take the detected family; a checkpoint of another family
    raises ModelLoadError. Floating-point tensors are converted to `dtype`; integer ones (d2t) are kept.
    """
    path = os.fspath(path)
    if method is not None and method not in DRAFTER_METHODS:
        raise ValueError(f"drafter method {method!r} is not supported (supported: {', '.join(DRAFTER_METHODS)})")
    if not os.path.exists(path):
        raise FileNotFoundError(f"drafter checkpoint not found: {path}")
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    config = _read_config(folder)
    files = _weight_files(path)
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(_read_weights(file, dtype))
    family = _detect_family(config, state, files) or ("medusa" if method == "medusa" else None)
    if family is None:
        raise ModelLoadError(
            f"{path}: missing tensor 'fc.weight' (EAGLE: [H, 2H], EAGLE-3: [H, 3 * target hidden]) and no Medusa "
            f"heads; found {_preview(state)}")
    if method is not None and family != method:
        raise ModelLoadError(f"{path}: speculative method {method!r} was given, but this is {_describe(family)} "
                             f"checkpoint; use method {family!r}")
    if family == "medusa":
        return _medusa_checkpoint(path, config, state)
    return _eagle_checkpoint(path, family, config, state)


def expect_tensor(checkpoint: DrafterCheckpoint, name: str, shape: tuple[int, ...], why: str = "") -> torch.Tensor:
    """checkpoint.state_dict[name], or a ModelLoadError naming the tensor, its shape and the one expected."""
    tensor = checkpoint.state_dict.get(name)
    note = f" ({why})" if why else ""
    if tensor is None:
        raise ModelLoadError(f"{checkpoint.source}: missing tensor {name!r}, expected shape {list(shape)}{note}")
    if tuple(tensor.shape) != tuple(shape):
        in_file = checkpoint.file_names.get(name, name)
        where = f" (in the file: {in_file!r})" if in_file != name else ""
        raise ModelLoadError(f"{checkpoint.source}: tensor {name!r}{where} has shape {list(tensor.shape)}, expected "
                             f"{list(shape)}{note}")
    return tensor


def build_drafter_head(checkpoint: DrafterCheckpoint, target, weight_dtype=None):
    """The head for a loaded checkpoint, checked against `target` (a LlamaForCausalLM)."""
    from specserve.models.eagle import Eagle3Head, EagleHead
    from specserve.models.medusa import MedusaHeads

    head_class = {"eagle": EagleHead, "eagle3": Eagle3Head, "medusa": MedusaHeads}[checkpoint.family]
    return head_class(checkpoint, target, weight_dtype=weight_dtype)


# ---------------------------------------------------------------- files


def _read_config(folder: str) -> dict:
    file = os.path.join(folder, "config.json")
    if not os.path.isfile(file):
        return {}
    try:
        return json.loads(Path(file).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{file}: not valid JSON ({e})") from e


def _weight_files(path: str) -> list[str]:
    """The weight files to read: the file itself, a Medusa head file, the safetensors, or a torch file."""
    if os.path.isfile(path):
        return [path]
    medusa = [os.path.join(path, name) for name in _MEDUSA_FILES if os.path.isfile(os.path.join(path, name))]
    if medusa:
        return medusa[:1]  # a folder may carry both formats of the same heads
    if any(Path(path).glob("*.safetensors")) or os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
        return safetensors_files(path)
    torch_files = [os.path.join(path, name) for name in _TORCH_FILES if os.path.isfile(os.path.join(path, name))]
    if torch_files:
        return torch_files[:1]
    raise FileNotFoundError(f"{path}: no drafter weights found (expected *.safetensors, pytorch_model.bin or "
                            f"medusa_lm_head.safetensors / medusa_lm_head.pt)")


def _read_weights(file: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    try:
        if file.endswith(".safetensors"):
            from safetensors.torch import load_file

            raw = load_file(file)
        else:
            raw = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # safetensors and torch.load raise their own types for damaged or pickled files
        raise ModelLoadError(f"{file}: cannot read drafter weights ({e})") from e
    if not isinstance(raw, dict) or not all(isinstance(t, torch.Tensor) for t in raw.values()):
        raise ModelLoadError(f"{file}: expected a dict of tensors (a state dict)")
    return {name: t.to(dtype) if t.is_floating_point() else t for name, t in raw.items()}


def _preview(state: dict) -> str:
    names = sorted(state)
    return f"{len(names)} tensor(s) {names[:6]}{' ...' if len(names) > 6 else ''}"


def _describe(family: str) -> str:
    return {"eagle": "an EAGLE-1/2", "eagle3": "an EAGLE-3", "medusa": "a Medusa"}[family]


# ---------------------------------------------------------------- detection


def _detect_family(config: dict, state: dict[str, torch.Tensor], files: list[str]) -> str | None:
    """From the weights first (architecture names are not reliable: official EAGLE-3 says LlamaForCausalLM)."""
    names = set(state)
    if (any(os.path.basename(f).startswith("medusa_lm_head") for f in files)
            or "medusa_num_heads" in config or config.get("model_type") == "medusa"
            or any(_is_medusa_key(_strip(n, ("medusa_head.", "model."))) for n in names)):
        return "medusa"
    stripped = {_strip(n, ("model.",)) for n in names}
    layer_cfg = config.get("transformer_layer_config") or config
    fc = state.get("fc.weight", state.get("model.fc.weight"))
    eagle3 = (any(n.startswith("midlayer.") or n.endswith("hidden_norm.weight") for n in stripped)
              or "d2t" in stripped or config.get("speculators_model_type") == "eagle3"
              or any(a in _EAGLE3_ARCHITECTURES for a in config.get("architectures") or ())
              or (fc is not None and "hidden_size" in layer_cfg and fc.dim() == 2
                  and fc.shape[1] == 3 * (config.get("target_hidden_size") or layer_cfg["hidden_size"])))
    if eagle3:
        return "eagle3"
    return "eagle" if fc is not None else None


def _is_medusa_key(name: str) -> bool:
    return any(p.match(name) for p in (_FASTERDECODING_BLOCK, _FASTERDECODING_HEAD, _VLLM_BLOCK, _VLLM_HEAD))


def _strip(name: str, prefixes: tuple[str, ...]) -> str:
    for prefix in prefixes:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


# ---------------------------------------------------------------- EAGLE-1 / EAGLE-3


def _eagle_checkpoint(source: str, family: str, config: dict, state: dict[str, torch.Tensor]) -> DrafterCheckpoint:
    canonical, ignored, file_names = {}, [], {}
    for name, tensor in state.items():
        key = _strip(name, ("model.",))
        if key.startswith("midlayer."):
            key = "layers.0." + key[len("midlayer."):]
        if key == "t2d" or key.endswith("rotary_emb.inv_freq") or (family == "eagle" and key == "lm_head.weight"):
            ignored.append(name)  # t2d: training only; EAGLE-1 predicts through the target's own LM head
            continue
        if key.startswith("layers."):
            if not key.startswith("layers.0.") or key[len("layers.0."):] not in _LAYER_PARTS:
                raise ModelLoadError(f"{source}: unexpected tensor {name!r}: {_describe(family)} draft has one "
                                     f"decoder layer, with the parts {list(_LAYER_PARTS)}")
        elif key not in _EAGLE_TOP:
            ignored.append(name)
            continue
        canonical[key] = tensor
        file_names[key] = name
    if "fc.weight" not in canonical:
        shape = "[H, 3 * target hidden]" if family == "eagle3" else "[H, 2H]"
        raise ModelLoadError(f"{source}: missing tensor 'fc.weight' ({shape}); found {_preview(state)}")
    if "d2t" in canonical and canonical["d2t"].is_floating_point():
        raise ModelLoadError(f"{source}: tensor 'd2t' must hold integers (draft-to-target id offsets), got "
                             f"{canonical['d2t'].dtype}")
    layer_config = _eagle_layer_config(source, config)
    checkpoint = DrafterCheckpoint(family, layer_config, canonical, source, ignored_keys=sorted(ignored),
                                   file_names=file_names)
    if family == "eagle3":
        aux = ((config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
               or config.get("eagle_aux_hidden_state_layer_ids"))  # official / speculators
        checkpoint.aux_layer_ids = tuple(int(i) for i in aux) if aux else None
        # speculators' own default is True; official and SpecForge drafts have no such step.
        default_nbr = config.get("speculators_model_type") == "eagle3"
        checkpoint.norm_before_residual = bool(config.get("norm_before_residual", default_nbr))
        checkpoint.draft_vocab_size = int(config.get("draft_vocab_size") or layer_config["vocab_size"])
    return checkpoint


def _eagle_layer_config(source: str, config: dict) -> dict:
    """The draft layer's Llama fields; speculators nests them under `transformer_layer_config`."""
    if not config:
        raise ModelLoadError(f"{source}: an EAGLE checkpoint needs a config.json with the draft layer's sizes")
    layer = dict(config.get("transformer_layer_config") or config)
    for key in ("target_hidden_size", "draft_vocab_size"):
        if config.get(key) is not None:
            layer[key] = config[key]
    required = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
    missing = [key for key in required if layer.get(key) is None]
    if missing:
        raise ModelLoadError(f"{source}: config.json lacks the draft layer field(s) {missing}")
    return layer


# ---------------------------------------------------------------- Medusa


def _medusa_checkpoint(source: str, config: dict, state: dict[str, torch.Tensor]) -> DrafterCheckpoint:
    """FasterDecoding (`{i}.{j}.linear.*` ResBlocks, `{i}.{num_layers}.weight` projection) or vLLM
    (`blocks.{i}.layers.{j}.*`, `lm_heads.{i}.weight`) keys, as vLLM's names."""
    if any(n.startswith("medusa_head.") for n in state):  # a full Medusa-2 repo: heads next to the backbone
        ignored = sorted(n for n in state if not n.startswith("medusa_head."))
        state = {n[len("medusa_head."):]: t for n, t in state.items() if n.startswith("medusa_head.")}
    else:
        ignored = []
    blocks: dict[tuple[int, int, str], tuple[str, torch.Tensor]] = {}  # values: (name in the file, tensor)
    heads: dict[tuple[int, int | None, str], tuple[str, torch.Tensor]] = {}  # (head, position or None, kind)
    canonical: dict[str, torch.Tensor] = {}
    file_names: dict[str, str] = {}
    for name, tensor in state.items():
        key = _strip(name, ("model.",))
        if m := _FASTERDECODING_BLOCK.match(key) or _VLLM_BLOCK.match(key):
            blocks[int(m[1]), int(m[2]), m[3]] = name, tensor
        elif m := _FASTERDECODING_HEAD.match(key):
            heads[int(m[1]), int(m[2]), m[3]] = name, tensor
        elif m := _VLLM_HEAD.match(key):
            heads[int(m[1]), None, m[2]] = name, tensor
        elif key == "token_map":
            canonical["token_map"] = tensor
        else:
            ignored.append(name)
    head_ids = sorted({i for i, _, _ in blocks} | {i for i, _, _ in heads})
    if not head_ids:
        raise ModelLoadError(
            f"{source}: no Medusa heads found (expected keys like '0.0.linear.weight' and '0.1.weight' "
            f"(FasterDecoding) or 'blocks.0.layers.0.weight' and 'lm_heads.0.weight' (vLLM)); found {_preview(state)}")
    if head_ids != list(range(len(head_ids))):
        raise ModelLoadError(f"{source}: Medusa heads must be numbered 0..K-1, found heads {head_ids}")
    num_layers = []
    for i in head_ids:
        layers = sorted({j for h, j, _ in blocks if h == i})
        if layers != list(range(len(layers))):
            raise ModelLoadError(f"{source}: Medusa head {i} has ResBlocks {layers}, expected 0..n-1")
        num_layers.append(len(layers))
        for (h, j, kind), (name, tensor) in blocks.items():
            if h == i:
                canonical[f"blocks.{i}.layers.{j}.{kind}"] = tensor
                file_names[f"blocks.{i}.layers.{j}.{kind}"] = name
        for (h, j, kind), (name, tensor) in heads.items():
            if h != i:
                continue
            if j is not None and j != len(layers):  # FasterDecoding: the projection follows the ResBlocks
                raise ModelLoadError(f"{source}: unexpected tensor '{i}.{j}.{kind}': head {i} has {len(layers)} "
                                     f"ResBlock(s), so its vocabulary projection is '{i}.{len(layers)}.weight'")
            canonical[f"lm_heads.{i}.{kind}"] = tensor
            file_names[f"lm_heads.{i}.{kind}"] = name
    return DrafterCheckpoint("medusa", config, canonical, source, num_heads=len(head_ids), num_layers=num_layers,
                             ignored_keys=sorted(ignored), file_names=file_names)


def cast_weight(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A checkpoint tensor in the model's dtype, contiguous (None stays None)."""
    return None if t is None else t.to(dtype).contiguous()


def to_target_vocab(logits: torch.Tensor, target_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """logits: [M, Vd] over a draft vocabulary whose ids map to target_ids [Vd] -> [M, vocab_size] with
    -inf elsewhere (a softmax then gives the draft's probabilities over the target vocabulary); as is
    when target_ids is None (the draft predicts over the target vocabulary)."""
    if target_ids is None:
        return logits
    out = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
    out[:, target_ids] = logits
    return out
