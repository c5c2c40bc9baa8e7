"""Sliding-window attention and Gemma 3 against transformers, through the paged KV cache."""
import pytest
import torch

from specserve.models.llama import sliding_windows
from specserve.models.registry import build_model
from specserve.ops import kernels
from tests.kernel_support import require_c_kernels
from tests.models.test_llama_parity import _reference_logits
from tests.paged_harness import max_logit_errors
from tests.tiny_models import hf_config_dict, hf_state_dict, tiny_hf_model

# windows of 5-6 tokens against prompts of 5-22 tokens and 10 decode steps
CASES = {
    "mistral": dict(kind="mistral", sliding_window=5),
    "qwen2 windows from layer 1": dict(kind="qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=1),
    "gemma3 tied": dict(kind="gemma3", tie=True, num_hidden_layers=3),
    "gemma3 untied": dict(kind="gemma3", tie=False, num_hidden_layers=4),
}


@pytest.mark.parametrize("ops", ["c", "torch"])
@pytest.mark.parametrize("case", list(CASES))
def test_prefill_and_decode_match_transformers(case, ops, monkeypatch):
    if ops == "c":
        require_c_kernels()
    monkeypatch.setenv(kernels.ENV_VAR, ops)
    hf = tiny_hf_model(**CASES[case])
    model = build_model(hf_config_dict(hf), hf_state_dict(hf), dtype=torch.float32)
    assert any(layer.window for layer in model.layers)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (13, 5, 22)]
    worst = max_logit_errors(model, prompts, 10, 7, lambda tokens: _reference_logits(hf, tokens))
    assert max(worst.values()) < 1e-4, worst


def test_windows_follow_transformers_config_rules():
    base = dict(num_hidden_layers=3, sliding_window=4)
    assert sliding_windows(dict(base, model_type="mistral")) == (4, 4, 4)
    assert sliding_windows(dict(base, model_type="mistral", sliding_window=None)) == ()
    assert sliding_windows(dict(base, model_type="qwen2")) == ()  # use_sliding_window off
    assert sliding_windows(dict(base, model_type="qwen2", use_sliding_window=True, max_window_layers=2)) == (0, 0, 4)
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    assert sliding_windows(dict(base, model_type="gemma3_text", layer_types=types)) == (4, 0, 4)
    with pytest.raises(ValueError, match="layer_types"):
        sliding_windows(dict(base, layer_types=["chunked_attention"] * 3))
    with pytest.raises(ValueError, match="sliding_window"):
        sliding_windows(dict(base, sliding_window=0, layer_types=types))


def test_gemma3_aux_hidden_states_are_transformers_hidden_states():
    hf = tiny_hf_model("gemma3", num_hidden_layers=3)
    model = build_model(hf_config_dict(hf), hf_state_dict(hf), dtype=torch.float32)
    model.set_aux_hidden_layers((2, 0))
    tokens = torch.randint(0, 160, (11,), generator=torch.Generator().manual_seed(2))
    from specserve.ops.attention import build_attention_metadata, kv_caches

    caches = kv_caches(model.kv_cache_shape(2, 16), torch.float32, model.num_layers)
    meta = build_attention_metadata([11], [11], [[1]], 16, torch.arange(16, 27), kernels.kernel_usable(torch.float32))
    with torch.inference_mode():
        _, aux = model.forward(tokens, torch.arange(11), meta, caches)
        expected = hf(tokens[None], output_hidden_states=True).hidden_states
    for state, layer in zip(aux, (2, 0)):
        torch.testing.assert_close(state, expected[layer][0], atol=1e-5, rtol=1e-5)


def test_gemma3_refuses_what_it_does_not_implement():
    hf = tiny_hf_model("gemma3", num_hidden_layers=3)
    for key, value in (("final_logit_softcapping", 30.0), ("hidden_activation", "relu")):
        with pytest.raises(ValueError, match=key):
            build_model({**hf_config_dict(hf), key: value}, hf_state_dict(hf), dtype=torch.float32)


def test_multimodal_gemma3_checkpoint_serves_its_text_decoder(tmp_path):
    """A Gemma 3 4B-style folder (model_type "gemma3": text_config, vision tower, `language_model.` names): its
    text decoder loads and generates transformers' greedy tokens for text prompts."""
    import os

    import tokenizers
    import transformers
    from tokenizers.models import WordLevel

    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams
    from tests.tiny_models import perturb_norms_and_biases

    torch.manual_seed(5)
    text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, vocab_size=300, sliding_window=6, max_position_embeddings=256, query_pre_attn_scalar=24,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=299, boi_token_index=297, eoi_token_index=298)
    hf = perturb_norms_and_biases(transformers.Gemma3ForConditionalGeneration(config).eval())
    hf.save_pretrained(str(tmp_path))
    vocab = {f"t{i}": i for i in range(300)}
    tokenizers.Tokenizer(WordLevel(vocab, unk_token="t0")).save(os.path.join(tmp_path, "tokenizer.json"))
    prompt = torch.randint(3, 290, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(hf(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    llm = LLM(model=str(tmp_path), max_model_len=128, max_num_batched_tokens=8, block_size=4)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == ids[20:]
