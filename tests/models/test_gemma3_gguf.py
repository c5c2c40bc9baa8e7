"""Gemma 3 270M (Q4_K_M GGUF) against transformers on the same dequantized weights, and its blocks on the C
GEMM against their dequantized selves."""
import numpy as np
import pytest
import torch

from specserve.llm import LLM
from specserve.models.gguf_loader import dequantized, load_gguf, open_gguf
from specserve.models.gguf_quant import QuantizedWeight
from specserve.models.linear import FastLinear
from specserve.sampling_params import SamplingParams
from specserve.tokenizer import load_tokenizer
from tests.kernel_support import requires_c_kernels

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,",
           "Water boils at a temperature of"]


@pytest.fixture(scope="module")
def loaded(gemma3_gguf_path):
    return load_gguf(gemma3_gguf_path, keep_quantized=True)


def _transformers_model(config: dict, state_dict: dict):
    import transformers

    rope = {"full_attention": {"rope_type": "default", "rope_theta": config["rope_theta"]},
            "sliding_attention": {"rope_type": "default", "rope_theta": config["rope_local_base_freq"]}}
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "sliding_window", "layer_types",
            "query_pre_attn_scalar", "max_position_embeddings", "tie_word_embeddings", "hidden_activation")
    hf_config = transformers.Gemma3TextConfig(**{k: config[k] for k in keys}, rope_parameters=rope)
    model = transformers.Gemma3ForCausalLM(hf_config).eval()
    missing, unexpected = model.load_state_dict(dequantized(state_dict), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model.float()


def test_gguf_config_is_gemma3s(loaded):
    config, state_dict = loaded
    assert config["model_type"] == "gemma3_text" and config["sliding_window"] == 512
    assert config["layer_types"].count("full_attention") == 3 and config["layer_types"][5] == "full_attention"
    assert config["query_pre_attn_scalar"] == 256 and config["head_dim"] == 256
    # Q5_0, Q8_0, Q4_K and Q6_K blocks all stay in their blocks
    kinds = {w.qtype for w in state_dict.values() if isinstance(w, QuantizedWeight)}
    assert kinds == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}, kinds
    # llama.cpp stores the norms' 1 + w; the state dict holds transformers' w
    assert abs(state_dict["model.layers.0.self_attn.q_norm.weight"].mean().item()) < 2.0


def test_fp32_greedy_tokens_are_transformers(gemma3_gguf_path, loaded):
    """24 greedy tokens per prompt; one prompt past the 512-token window, so the local layers' windows act."""
    tok = load_tokenizer(gemma3_gguf_path)
    long_text = " ".join(f"Item {i} is a {'red' if i % 3 else 'blue'} box." for i in range(90))
    prompts = [tok.encode(p) for p in PROMPTS] + [tok.encode(long_text + " The last item is")]
    assert len(prompts[-1]) > 600
    llm = LLM(model=gemma3_gguf_path, gguf_compute="fp32", max_model_len=1024)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    hf = _transformers_model(*loaded)
    with torch.no_grad():
        for ids, got in zip(prompts, ours):
            out = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, min_new_tokens=24)
            assert list(got) == out[0, len(ids):].tolist()


@requires_c_kernels
def test_default_path_follows_the_exact_model(gemma3_gguf_path, loaded):
    """The default path (4-bit blocks with two int8 digits per activation) within the documented tolerance of
    the fp32 path: teacher-forced next tokens agree at >= 98% of positions, KL < 1e-4 nats."""
    from specserve.models.registry import build_model
    from tests.models.test_gguf_quant import _teacher_forced_logits, int8_activation_weights

    config, state_dict = loaded
    exact = build_model(config, state_dict, dtype=torch.float32)
    default = build_model(config, int8_activation_weights(state_dict), dtype=torch.float32)
    tokens = torch.tensor(load_tokenizer(gemma3_gguf_path).encode(
        "Speculative decoding drafts several tokens cheaply and verifies them in one step of the target model, "
        "so that greedy output stays exactly what plain decoding gives while each step emits more tokens."))
    want, got = _teacher_forced_logits(exact, tokens), _teacher_forced_logits(default, tokens)
    assert (want.argmax(-1) == got.argmax(-1)).float().mean().item() >= 0.98
    p, q = want.log_softmax(-1), got.log_softmax(-1)
    assert (p.exp() * (p - q)).sum(-1).max().item() < 1e-4


@pytest.fixture(scope="module")
def reader(gemma3_gguf_path):
    return open_gguf(gemma3_gguf_path)


@requires_c_kernels
@pytest.mark.parametrize("qtype", ["Q5_0", "Q8_0", "Q4_K", "Q6_K"])
def test_block_gemm_is_bitwise_its_dequantized_self(reader, qtype):
    """Each block type of the file through the C GEMM with fp32 activations: the same bits as the fp32 GEMM on
    the dequantized weight (which is the gguf package's dequantization)."""
    from gguf.quants import dequantize

    tensor = next(t for t in reader.tensors if t.tensor_type.name == qtype and len(t.shape) == 2
                  and t.name != "token_embd.weight")
    shape = tuple(int(d) for d in reversed(tensor.shape))
    weight = QuantizedWeight.from_gguf(tensor.data, qtype, shape)
    reference = dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)
    assert torch.equal(weight.dequantize(), torch.from_numpy(reference))
    x = torch.randn(9, shape[1], generator=torch.Generator().manual_seed(0))
    for rows in (1, 9):
        got = FastLinear(weight)(x[:rows])
        want = FastLinear(torch.from_numpy(reference))(x[:rows])
        assert torch.equal(got, want), (qtype, rows)
