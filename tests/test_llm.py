"""End to end on the default model (SmolLM2-135M-Instruct GGUF): correctness against references."""
import json
import os

import pytest
import torch

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Translate to French: Good morning, how are you?",
    "1, 2, 3, 4, 5,",
    "Photosynthesis is the process by which",
    "Question: What is the boiling point of water at sea level?\nAnswer:",
]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=1024, max_num_batched_tokens=512)


def _solo(llm, prompt, params):
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def test_greedy_matches_transformers_on_the_same_gguf(llm, default_gguf_path):
    import os

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(default_gguf_path),
                                              gguf_file=os.path.basename(default_gguf_path),
                                              dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS[:4], outs):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
        assert out.outputs[0].token_ids == ref.tolist(), prompt
    assert "Paris" in outs[0].outputs[0].text


def test_greedy_steps_screen_the_lm_head_and_keep_the_full_logits_tokens(llm):
    """Greedy decoding and greedy verification take the LM head's exact argmax (an int8 screen, then the
    survivors in fp32) instead of the full logits: the tokens are the full logits' argmax, every one."""
    from specserve.ops.kernels import kernel_enabled

    model = llm.llm_engine.runner.model
    assert model.exact_argmax == kernel_enabled()
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    screened = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    model.exact_argmax = False
    try:
        full = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        model.exact_argmax = kernel_enabled()
    assert screened == full


def test_batch_with_chunked_prefill_and_preemption_matches_each_prompt_alone(default_gguf_path):
    # 16 blocks of 16 tokens for 16 requests, budget 32 tokens: prefills chunk and requests get preempted.
    small = LLM(max_model_len=256, max_num_batched_tokens=32, num_kv_blocks=24, block_size=16)
    prompts = [(PROMPTS[i % len(PROMPTS)] + " ") * (1 + i % 4) for i in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    together = small.generate(prompts, params, use_tqdm=False)
    assert small.get_metrics().num_preemptions > 0
    for prompt, out in zip(prompts, together):
        assert out.outputs[0].token_ids == _solo(small, prompt, params), prompt


def test_prefix_cache_hit_gives_identical_output(llm):
    shared = "You are a careful assistant. " * 12
    first = llm.generate([shared + "Name a fruit."], GREEDY, use_tqdm=False)[0]
    hits_before = llm.get_metrics().prefix_cache_hits
    second = llm.generate([shared + "Name a fruit."], GREEDY, use_tqdm=False)[0]
    assert llm.get_metrics().prefix_cache_hits - hits_before >= 64
    assert second.num_cached_tokens >= 64
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    no_cache = LLM(max_model_len=1024, enable_prefix_caching=False)
    assert _solo(no_cache, shared + "Name a fruit.", GREEDY) == first.outputs[0].token_ids


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    alone = _solo(llm, PROMPTS[2], seeded)
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batch = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[5]], [others, seeded, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    again = _solo(llm, PROMPTS[2], seeded)
    assert again == alone


def test_n_stop_strings_and_logprobs(llm):
    out = llm.generate(["1, 2, 3, 4, 5,"], SamplingParams(temperature=0.0, max_tokens=30, stop=[" 9"],
                                                            logprobs=3), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == " 9"
    assert " 9" not in c.text and c.text.strip().startswith("6")
    assert len(c.logprobs) == len(c.token_ids)
    for tid, entry in zip(c.token_ids, c.logprobs):
        assert tid in entry and entry[tid].rank == 1 and len(entry) == 3
    two = llm.generate([PROMPTS[2]], SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8), use_tqdm=False)[0]
    assert [o.index for o in two.outputs] == [0, 1]
    assert two.outputs[0].token_ids != two.outputs[1].token_ids


def test_bad_prompt_fails_alone(llm):
    long_prompt = list(range(100, 1200))
    outs = llm.generate([PROMPTS[0], long_prompt], GREEDY, use_tqdm=False)
    assert outs[1].error and "max_model_len" in outs[1].error and outs[1].outputs[0].finish_reason == "error"
    assert outs[0].outputs[0].token_ids == _solo(llm, PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_chat_renders_the_template(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)[0]
    assert out.prompt.startswith("<|im_start|>system")
    assert "Paris" in out.outputs[0].text


def test_kv_cache_too_small_for_one_sequence_says_how_much_is_needed():
    with pytest.raises(ValueError, match=r"needs [0-9.]+ MiB"):
        LLM(max_model_len=1024, kv_cache_memory_bytes=1 << 20)


@pytest.mark.parametrize("kwargs", [{"dtype": "bfloat16"}, {"quantization": "int8"}])
def test_reduced_precision_weights_still_answer(kwargs):
    out = LLM(max_model_len=256, **kwargs).generate(["The capital of France is"], GREEDY, use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text


def _untrained_copy(head: str, folder: str) -> str:
    """A freshly initialized EAGLE-3 head with the shipped head's shapes and draft vocabulary."""
    from safetensors.torch import load_file

    from specserve.models.loader import load_model_weights
    from specserve.train.eagle3 import Eagle3DraftModel, Eagle3HeadConfig, Eagle3Objective, build_vocab_from_d2t
    from specserve.train.features import TargetParts

    target = load_model_weights(None)
    tensors = load_file(os.path.join(head, "model.safetensors"))
    vocab = build_vocab_from_d2t(tensors["d2t"], tensors["t2d"])
    config = Eagle3HeadConfig.from_target(target.config, len(vocab.token_ids), (2, 15, 27))
    torch.manual_seed(0)
    parts = TargetParts.from_state_dict(target.config, target.state_dict)
    Eagle3Objective(Eagle3DraftModel(config, parts.embed_tokens, vocab, parts.lm_head)).save(folder)
    return folder


def test_shipped_eagle3_head_drafts_the_default_model_losslessly(llm, tmp_path):
    """{"method": "eagle3"} with no model: the head shipped for SmolLM2 (specserve/heads). Greedy output is
    plain decoding's, and its drafts are accepted clearly more often than those of an untrained head of the
    same shape (on two prompts like those it was trained on, held back from data/distill/prompts.jsonl)."""
    from specserve.heads import bundled_head

    params = SamplingParams(temperature=0.0, max_tokens=64)
    path = os.path.join(os.path.dirname(__file__), "..", "data", "distill", "prompts.jsonl")
    rows = [json.loads(line) for line in open(path)]
    prompts = [[{"role": "user", "content": rows[i]["prompt"]}] for i in (31, 63)]  # held back (id % 32 == 31)
    plain = [o.outputs[0].token_ids for o in llm.chat(prompts, params, use_tqdm=False)]
    untrained = _untrained_copy(bundled_head("eagle3", None), str(tmp_path / "untrained"))
    accepted = {}
    for name, spec in (("shipped", {"method": "eagle3"}), ("untrained", {"method": "eagle3", "model": untrained})):
        engine = LLM(max_model_len=1024, max_num_batched_tokens=512,
                     speculative_config={**spec, "adaptive_draft_length": False})
        assert [o.outputs[0].token_ids for o in engine.chat(prompts, params, use_tqdm=False)] == plain
        m = engine.get_metrics()
        accepted[name] = m.num_accepted_tokens / m.num_drafts
    print(f"accepted tokens per round: {accepted}")
    assert accepted["shipped"] > accepted["untrained"] + 0.2, accepted
