"""Qwen2.5-Coder-0.5B-Instruct (the official Q4_K_M GGUF: Q5_0, Q8_0, Q4_K and Q6_K blocks) against
transformers on the same dequantized weights, and the default path (int8 activations) against the exact one."""
import pytest
import torch

from specserve.llm import LLM
from specserve.models.gguf_loader import dequantized, load_gguf
from specserve.models.gguf_quant import QuantizedWeight, int8_activation_weights
from specserve.models.registry import build_model
from specserve.sampling_params import SamplingParams
from specserve.tokenizer import load_tokenizer
from tests.kernel_support import requires_c_kernels
from tests.models.test_gguf_quant import _teacher_forced_logits

PROMPTS = ["def fibonacci(n):\n", "# Sort a list of dictionaries by the key 'age'\n",
           "The capital of France is", "SELECT name FROM users WHERE"]
# The default path's bound against the exact model, as the catalog models promise (docs/models.md)
AGREEMENT, KL_NATS = 0.98, 1e-3


@pytest.fixture(scope="module")
def loaded(qwen_coder_05b_path):
    return load_gguf(qwen_coder_05b_path, keep_quantized=True)


def _transformers_model(config: dict, state_dict: dict):
    import transformers

    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings")
    hf_config = transformers.Qwen2Config(**{k: config[k] for k in keys},
                                         rope_parameters={"rope_type": "default", "rope_theta": config["rope_theta"]})
    model = transformers.Qwen2ForCausalLM(hf_config).eval()
    missing, unexpected = model.load_state_dict(dequantized(state_dict), strict=True)
    assert not missing and not unexpected
    return model.float()


def test_the_file_keeps_every_block_type(loaded):
    config, state_dict = loaded
    assert config["model_type"] == "qwen2" and config["vocab_size"] == 151936 and config["attention_bias"]
    kinds = {w.qtype for w in state_dict.values() if isinstance(w, QuantizedWeight)}
    assert kinds == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}, kinds


def test_fp32_greedy_tokens_are_transformers(qwen_coder_05b_path, loaded):
    """16 greedy tokens per prompt from the engine's exact path (fp32 activations on the file's blocks) and
    from transformers on the dequantized weights."""
    tok = load_tokenizer(qwen_coder_05b_path)
    prompts = [tok.encode(p) for p in PROMPTS]
    llm = LLM(model=qwen_coder_05b_path, gguf_compute="fp32", max_model_len=256, kv_cache_memory_bytes=64 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ours = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    hf = _transformers_model(*loaded)
    with torch.no_grad():
        for ids, got in zip(prompts, ours):
            out = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, min_new_tokens=16)
            assert got == out[0, len(ids):].tolist()


@requires_c_kernels
def test_default_path_follows_the_exact_model(qwen_coder_05b_path, loaded):
    """The default path (int8 activations) against the exact one, teacher-forced on a code prompt: next tokens
    agree at >= 98% of positions and the KL divergence stays below 1e-3 nats at every position."""
    config, state_dict = loaded
    exact = build_model(config, state_dict, dtype=torch.float32)
    default = build_model(config, int8_activation_weights(state_dict), dtype=torch.float32)
    tokens = torch.tensor(load_tokenizer(qwen_coder_05b_path).encode(
        "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n"
        "    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
        "    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
        "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n"
        "        else:\n            out.append(b[j])\n            j += 1\n"
        "    return out + a[i:] + b[j:]\n"))
    want, got = _teacher_forced_logits(exact, tokens), _teacher_forced_logits(default, tokens)
    assert (want.argmax(-1) == got.argmax(-1)).float().mean().item() >= AGREEMENT
    p, q = want.log_softmax(-1), got.log_softmax(-1)
    assert (p.exp() * (p - q)).sum(-1).max().item() < KL_NATS
