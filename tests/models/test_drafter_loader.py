"""Drafter checkpoints in each public layout load, detect their family and map to canonical names; a
checkpoint that does not fit the target fails when its head is built, naming the tensor and both shapes."""
from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.models.drafter_loader import build_drafter_head, load_drafter_checkpoint
from specserve.models.eagle import Eagle3Head, EagleHead
from specserve.models.loader import ModelLoadError
from specserve.models.medusa import MedusaHeads
from specserve.models.registry import build_model
from tests.models.drafter_checkpoints import write_eagle, write_eagle3, write_medusa
from tests.tiny_models import hf_config_dict, hf_state_dict, tiny_hf_model

EAGLE_LAYER = {"layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
               "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
               "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
               "layers.0.post_attention_layernorm.weight"}
EAGLE3_LAYER = EAGLE_LAYER | {"layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight"}


@pytest.fixture(scope="module")
def hf_target():
    return tiny_hf_model("llama", tie=True, num_hidden_layers=8)


def target_model(hf, **overrides):
    """Our model of `hf`, or of a fresh tiny Llama with the given config overrides."""
    if overrides:
        hf = tiny_hf_model("llama", tie=True, num_hidden_layers=8, **overrides)
    return build_model(hf_config_dict(hf), hf_state_dict(hf), dtype=torch.float32)


LAYOUTS = {
    "eagle-safetensors": (lambda d, c: write_eagle(d, c), "eagle"),
    "eagle-no-fc-bias": (lambda d, c: write_eagle(d, c, fc_bias=False), "eagle"),
    "eagle-bin": (lambda d, c: write_eagle(d, c, weights_format="bin"), "eagle"),
    "eagle-model-prefix-embed": (lambda d, c: write_eagle(d, c, prefix="model.", embed_tokens=torch.randn(160, 64)),
                                 "eagle"),
    "eagle3-official": (lambda d, c: write_eagle3(d, c, layout="official"), "eagle3"),
    "eagle3-sglang": (lambda d, c: write_eagle3(d, c, layout="sglang"), "eagle3"),
    "eagle3-speculators": (lambda d, c: write_eagle3(d, c, layout="speculators", aux_layer_ids=[1, 4, 6]), "eagle3"),
    "medusa-fd-safetensors": (lambda d, c: write_medusa(d, c), "medusa"),
    "medusa-fd-pt": (lambda d, c: write_medusa(d, c, weights_format="pt", num_layers=2), "medusa"),
    "medusa-fd-medusa2": (lambda d, c: write_medusa(d, c, medusa_head_prefix=True, own_lm_heads=False), "medusa"),
    "medusa-vllm": (lambda d, c: write_medusa(d, c, layout="vllm"), "medusa"),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_layout_loads_with_its_family(tmp_path, hf_target, name):
    write, family = LAYOUTS[name]
    written = write(str(tmp_path), hf_target.config)
    detected = load_drafter_checkpoint(written.folder)
    assert detected.family == family
    ckpt = load_drafter_checkpoint(written.folder, family)
    keys = set(ckpt.state_dict)
    if family == "eagle":
        assert EAGLE_LAYER <= keys and "fc.weight" in keys
        assert ("fc.bias" in keys) == (name != "eagle-no-fc-bias")
        assert not any(k.startswith("model.") for k in keys)
    elif family == "eagle3":
        assert EAGLE3_LAYER | {"fc.weight", "norm.weight", "lm_head.weight", "d2t"} <= keys
        assert "t2d" not in keys and "t2d" in ckpt.ignored_keys
        assert not any(k.startswith("midlayer.") for k in keys)
        assert ckpt.draft_vocab_size == 80 and ckpt.state_dict["d2t"].dtype == torch.int64
        assert ckpt.norm_before_residual == (name == "eagle3-speculators")
        assert ckpt.aux_layers_for(8) == ((1, 4, 6) if name == "eagle3-speculators" else (2, 4, 5))
    else:
        layers = 2 if name == "medusa-fd-pt" else 1
        assert ckpt.num_heads == 3 and ckpt.num_layers == [layers] * 3  # from the keys, not medusa_num_heads
        assert all(f"blocks.{i}.layers.{j}.weight" in keys for i in range(3) for j in range(layers))
        assert all((f"lm_heads.{i}.weight" in keys) == (name != "medusa-fd-medusa2") for i in range(3))
    aux = ckpt.aux_layers_for(8) if family == "eagle3" else ()
    target = build_model(hf_config_dict(hf_target), hf_state_dict(hf_target), dtype=torch.float32,
                         aux_hidden_layers=aux)
    head = build_drafter_head(ckpt, target)
    assert type(head) is {"eagle": EagleHead, "eagle3": Eagle3Head, "medusa": MedusaHeads}[family]


def test_a_medusa_file_can_be_named_directly(tmp_path, hf_target):
    written = write_medusa(str(tmp_path), hf_target.config, weights_format="pt")
    ckpt = load_drafter_checkpoint(os.path.join(written.folder, "medusa_lm_head.pt"))
    assert ckpt.family == "medusa" and ckpt.num_heads == 3


@pytest.mark.parametrize("method,write,found", [
    ("eagle", lambda d, c: write_eagle3(d, c), "EAGLE-3"),
    ("eagle3", lambda d, c: write_eagle(d, c), "EAGLE-1/2"),
    ("medusa", lambda d, c: write_eagle(d, c), "EAGLE-1/2"),
    ("eagle", lambda d, c: write_medusa(d, c), "Medusa"),
])
def test_method_and_family_mismatch(tmp_path, hf_target, method, write, found):
    folder = write(str(tmp_path), hf_target.config).folder
    with pytest.raises(ModelLoadError, match=f"method '{method}' was given, but this is an? {re.escape(found)}"):
        load_drafter_checkpoint(folder, method)


def test_unknown_method():
    with pytest.raises(ValueError, match="supported: eagle, eagle3, medusa"):
        load_drafter_checkpoint(".", "lookahead")


# ---------------------------------------------------------------- checks against the target


def test_wrong_hidden_size_names_the_tensor_and_both_shapes(tmp_path, hf_target):
    narrow = target_model(None, hidden_size=48, intermediate_size=80)
    eagle = load_drafter_checkpoint(write_eagle(str(tmp_path / "e"), hf_target.config).folder)
    with pytest.raises(ModelLoadError, match=re.escape("'fc.weight' has shape [64, 128], expected [48, 96]")):
        EagleHead(eagle, narrow)
    medusa = load_drafter_checkpoint(write_medusa(str(tmp_path / "m"), hf_target.config).folder)
    expected = "'blocks.0.layers.0.weight' (in the file: '0.0.linear.weight') has shape [64, 64], expected [48, 48]"
    with pytest.raises(ModelLoadError, match=re.escape(expected)):
        MedusaHeads(medusa, narrow)
    eagle3 = load_drafter_checkpoint(write_eagle3(str(tmp_path / "e3"), hf_target.config).folder)
    with pytest.raises(ModelLoadError, match=re.escape("'fc.weight' has shape [64, 192], expected [64, 144]")):
        Eagle3Head(eagle3, narrow)


def test_wrong_vocabulary_names_the_tensor_and_both_shapes(tmp_path, hf_target):
    small = target_model(None, vocab_size=120)
    eagle = load_drafter_checkpoint(write_eagle(str(tmp_path / "e"), hf_target.config,
                                                embed_tokens=torch.randn(160, 64)).folder)
    expected = "'embed_tokens.weight' has shape [160, 64], expected [120, 64]"
    with pytest.raises(ModelLoadError, match=re.escape(expected)):
        EagleHead(eagle, small)
    medusa = load_drafter_checkpoint(write_medusa(str(tmp_path / "m"), hf_target.config).folder)
    expected = "'lm_heads.0.weight' (in the file: '0.1.weight') has shape [160, 64], expected [120, 64]"
    with pytest.raises(ModelLoadError, match=re.escape(expected)):
        MedusaHeads(medusa, small)
    eagle3 = load_drafter_checkpoint(write_eagle3(str(tmp_path / "e3"), hf_target.config, draft_vocab_size=150).folder)
    with pytest.raises(ModelLoadError, match=r"'d2t' maps draft ids to target ids in \[\d+, 1[2-5]\d\], outside the "
                                             r"target's vocabulary of 120"):
        Eagle3Head(eagle3, small)
    # No tensor depends on the vocabulary: the config says which target the draft was made for.
    plain = load_drafter_checkpoint(write_eagle(str(tmp_path / "p"), hf_target.config).folder)
    with pytest.raises(ModelLoadError, match="config.json vocab_size 160 differs from the target's vocabulary of 120"):
        EagleHead(plain, small)


def _rewrite(folder: str, drop: str | None = None, add: dict | None = None, file: str = "model.safetensors") -> None:
    path = os.path.join(folder, file)
    tensors = {k: v for k, v in load_file(path).items() if k != drop}
    tensors.update(add or {})
    save_file(tensors, path)


@pytest.mark.parametrize("method", ["eagle", None])
def test_missing_fc_weight(tmp_path, hf_target, method):
    folder = write_eagle(str(tmp_path), hf_target.config).folder
    _rewrite(folder, drop="fc.weight")
    with pytest.raises(ModelLoadError, match=r"missing tensor 'fc.weight' \(EAGLE: \[H, 2H\]"):
        load_drafter_checkpoint(folder, method)


def test_missing_fc_weight_in_an_eagle3_checkpoint(tmp_path, hf_target):
    folder = write_eagle3(str(tmp_path), hf_target.config).folder
    _rewrite(folder, drop="fc.weight")
    with pytest.raises(ModelLoadError, match=re.escape("missing tensor 'fc.weight' ([H, 3 * target hidden])")):
        load_drafter_checkpoint(folder, "eagle3")


def test_missing_or_misshapen_layer_tensors(tmp_path, hf_target):
    target = target_model(hf_target)
    folder = write_eagle(str(tmp_path / "e"), hf_target.config).folder
    _rewrite(folder, drop="layers.0.mlp.down_proj.weight")
    with pytest.raises(ModelLoadError, match=re.escape("missing tensor 'layers.0.mlp.down_proj.weight', expected shape "
                                                       "[64, 96]")):
        EagleHead(load_drafter_checkpoint(folder), target)
    written = write_eagle3(str(tmp_path / "e3"), hf_target.config)
    _rewrite(written.folder, add={"midlayer.self_attn.q_proj.weight": torch.zeros(64, 64)})
    expected = ("'layers.0.self_attn.q_proj.weight' (in the file: 'midlayer.self_attn.q_proj.weight') has shape "
                "[64, 64], expected [64, 128]")
    with pytest.raises(ModelLoadError, match=re.escape(expected)):
        Eagle3Head(load_drafter_checkpoint(written.folder), target_model(hf_target))


def test_eagle1_with_an_input_norm_is_refused(tmp_path, hf_target):
    folder = write_eagle(str(tmp_path), hf_target.config).folder
    _rewrite(folder, add={"layers.0.input_layernorm.weight": torch.ones(64)})
    with pytest.raises(ModelLoadError, match="an EAGLE-1 layer has no input norm"):
        EagleHead(load_drafter_checkpoint(folder, "eagle"), target_model(hf_target))


def test_a_second_layer_is_refused(tmp_path, hf_target):
    folder = write_eagle(str(tmp_path), hf_target.config).folder
    _rewrite(folder, add={"layers.1.mlp.down_proj.weight": torch.ones(64, 96)})
    with pytest.raises(ModelLoadError, match="unexpected tensor 'layers.1.mlp.down_proj.weight'"):
        load_drafter_checkpoint(folder)


def test_eagle3_small_draft_vocab_needs_d2t(tmp_path, hf_target):
    folder = write_eagle3(str(tmp_path), hf_target.config, draft_vocab_size=50).folder
    _rewrite(folder, drop="d2t")
    with pytest.raises(ModelLoadError, match=re.escape("missing tensor 'd2t', expected shape [50]")):
        Eagle3Head(load_drafter_checkpoint(folder), target_model(hf_target))


def test_eagle3_full_vocab_without_head_or_map_shares_the_target_head(tmp_path, hf_target):
    target = target_model(hf_target)
    written = write_eagle3(str(tmp_path), hf_target.config, draft_vocab_size=160, with_lm_head=False)
    head = Eagle3Head(load_drafter_checkpoint(written.folder), target)
    assert head.lm_head is target.lm_head and head.draft_ids is None
    g = torch.randn(3, 64)
    with torch.inference_mode():
        assert torch.equal(head.greedy_tokens(g), head.compute_logits(g).argmax(-1))


def test_eagle3_aux_ids_must_fit_the_target(tmp_path, hf_target):
    ckpt = load_drafter_checkpoint(write_eagle3(str(tmp_path), hf_target.config, aux_layer_ids=[2, 4, 9]).folder)
    with pytest.raises(ModelLoadError, match=r"layers \[2, 4, 9\] do not fit a target of 8 layers"):
        Eagle3Head(ckpt, target_model(hf_target))


def test_medusa_file_without_heads(tmp_path):
    os.makedirs(tmp_path, exist_ok=True)
    json.dump({"medusa_num_heads": 3, "medusa_num_layers": 1}, open(tmp_path / "config.json", "w"))
    save_file({"lm_head.weight": torch.zeros(160, 64)}, str(tmp_path / "medusa_lm_head.safetensors"))
    with pytest.raises(ModelLoadError, match=r"no Medusa heads found \(expected keys like '0.0.linear.weight'"):
        load_drafter_checkpoint(str(tmp_path))
    with pytest.raises(ModelLoadError, match="no Medusa heads found"):
        load_drafter_checkpoint(str(tmp_path), "medusa")


def test_pickled_objects_are_not_loaded(tmp_path, hf_target):
    written = write_eagle(str(tmp_path), hf_target.config, weights_format="bin")
    pickled = {"fc.weight": torch.zeros(64, 128), "extra": object()}
    torch.save(pickled, os.path.join(written.folder, "pytorch_model.bin"))
    with pytest.raises(ModelLoadError, match="cannot read drafter weights"):
        load_drafter_checkpoint(written.folder)


def test_missing_folder_and_missing_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="drafter checkpoint not found"):
        load_drafter_checkpoint(str(tmp_path / "absent"))
    with pytest.raises(FileNotFoundError, match="no drafter weights found"):
        load_drafter_checkpoint(str(tmp_path))
