import os

import pytest

from specserve.config import EngineConfig, SpeculativeConfig
from specserve.heads import HEADS_DIR


@pytest.mark.parametrize("bad,match", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "prompt_lookup_min": 0}, "prompt_lookup"),
    ({"method": "eagle9"}, "method must be one of"),
    ({"method": "draft_model"}, "speculative_config.model is required"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "speculative_config.model is required for method 'medusa'"),
    ({"method": "ngram", "num_speculative_token": 3}, "unknown speculative_config key"),
    ({"num_speculative_tokens": 3}, "method is required"),
    ({"method": "draft_model", "model": "x.gguf", "quantization": "int4"}, "quantization must be None, 'int8' or 'q4'"),
    ({"method": "ngram", "quantization": "int8"}, "applies to methods draft_model, eagle, eagle3, medusa only"),
])
def test_invalid_speculative_configs_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(bad)


def test_eagle3_without_a_model_uses_the_shipped_head_on_the_default_model_only(default_gguf_path, tmp_path):
    shipped = os.path.join(HEADS_DIR, "smollm2-135m-instruct-eagle3")
    assert os.path.isfile(os.path.join(shipped, "model.safetensors"))
    for target in (None, default_gguf_path):
        assert SpeculativeConfig.from_dict({"method": "eagle3"}, target).model == shipped
    assert SpeculativeConfig.from_dict({"method": "eagle3", "model": str(tmp_path)}).model == str(tmp_path)
    with pytest.raises(ValueError, match="model is required for method 'eagle3'.*ships a head for the default model"):
        SpeculativeConfig.from_dict({"method": "eagle3"}, str(tmp_path))


def test_one_lookup_bound_is_copied_to_the_other():
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "prompt_lookup_max": 3})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (3, 3)


@pytest.mark.parametrize("field,value", [("max_num_seqs", 0), ("block_size", 0), ("dtype", "int3"),
                                         ("max_model_len", 1), ("num_kv_blocks", 0)])
def test_engine_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("bytes_per_weight, drafter, model_kept", [
    (4.0, "draft_model", True),  # fp32 target: the int8 self-draft reads a quarter of its bytes
    (2.0, "draft_model", True),  # bf16
    (0.6, "none", False),  # 4-bit GGUF blocks: an int8 copy would read more than the target
    (None, "draft_model", True),  # unknown storage: as before
])
def test_auto_keeps_the_int8_self_draft_only_where_it_reads_fewer_bytes(bytes_per_weight, drafter, model_kept):
    spec = SpeculativeConfig.from_dict({"method": "auto"}, "some/model.gguf", bytes_per_weight)
    assert spec.drafter == drafter
    assert (spec.model == "some/model.gguf") == model_kept
    if model_kept:
        assert spec.quantization == "int8"


def test_auto_with_a_head_drafter_uses_the_shipped_head_on_the_default_model():
    from specserve.heads import bundled_head

    spec = SpeculativeConfig.from_dict({"method": "auto", "drafter": "eagle3"}, None, 0.6)
    assert (spec.drafter, spec.model) == ("eagle3", bundled_head("eagle3", None)) and spec.model
    spec = SpeculativeConfig.from_dict({"method": "auto", "drafter": "eagle3", "model": "my/head"}, None, 0.6)
    assert spec.model == "my/head"


def test_an_explicit_auto_drafter_is_kept_on_a_quantized_target():
    spec = SpeculativeConfig.from_dict({"method": "auto", "drafter": "draft_model"}, "some/model.gguf", 0.6)
    assert (spec.drafter, spec.model, spec.quantization) == ("draft_model", "some/model.gguf", "int8")


def test_draft_tree_settings_are_checked():
    from specserve.config import SpeculativeConfig

    config = SpeculativeConfig(method="suffix", speculative_token_tree="[(0,), (1,), (0, 0)]")
    assert config.draft_tree == "static" and config.token_tree_shape == ((0,), (1,), (0, 0))
    for bad, message in [
        (dict(method="suffix", draft_tree="wide"), "draft_tree must be one of"),
        (dict(method="draft_model", model="m", draft_tree="auto"), "draft_tree applies to methods"),
        (dict(method="suffix", draft_tree="static"), "needs speculative_token_tree"),
        (dict(method="suffix", draft_tree="auto", speculative_token_tree="[(0,)]"), "goes with draft_tree 'static'"),
        (dict(method="suffix", speculative_token_tree="[(0,), (1, 0)]"), "without its parent"),
        (dict(method="suffix", speculative_token_tree="[(0,), (0,)]"), "twice"),
        (dict(method="suffix", speculative_token_tree="[(0, -1)]"), "ranks >= 0"),
        (dict(method="suffix", speculative_token_tree="(0"), "list of tuples of ranks"),
        (dict(method="suffix", draft_tree="auto", draft_tree_max_nodes=0), "draft_tree_max_nodes"),
    ]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig(**bad)


@pytest.mark.parametrize("method", [{"method": "eagle3"}, {"method": "auto", "drafter": "eagle3"}])
def test_the_shipped_head_drafts_from_4_bit_weights_beside_a_target_in_blocks(method):
    assert SpeculativeConfig.from_dict(dict(method), None, 0.6).quantization == "q4"
    assert SpeculativeConfig.from_dict(dict(method), None, 4.0).quantization is None  # fp32 target: fp32 head
    assert SpeculativeConfig.from_dict({**method, "quantization": "int8"}, None, 0.6).quantization == "int8"
    assert SpeculativeConfig.from_dict({**method, "model": "my/head"}, None, 0.6).quantization is None


def test_a_catalog_name_is_a_model_wherever_a_path_is(default_gguf_path):
    shipped = os.path.join(HEADS_DIR, "smollm2-135m-instruct-eagle3")
    assert EngineConfig(model="smollm2-135m-instruct").model == default_gguf_path
    assert SpeculativeConfig.from_dict({"method": "eagle3"}, "smollm2-135m-instruct").model == shipped
    draft = SpeculativeConfig.from_dict({"method": "draft_model", "model": "SmolLM2-135M-Instruct"})
    assert draft.model == default_gguf_path
