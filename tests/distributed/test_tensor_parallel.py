"""Tensor parallelism against one process: the same greedy tokens on SmolLM2 with and without speculation,
prefill logits within 1e-4, tiny Qwen2-VL, Llama (biases, padded vocabulary) and Qwen3 (q/k norms) models,
the Ray backend, clear errors for sizes that do not split, and no worker process left behind after a
failure, deletion or exit.
"""
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from specserve.distributed.executor import WorkerFailure
from specserve.distributed.layers import combine_argmax
from specserve.distributed.sharding import TensorShard, check_divisible
from specserve.llm import LLM
from specserve.models.llama import DecoderConfig
from specserve.ops.attention import kv_caches, paged_metadata
from specserve.ops.kernels import kernel_usable
from specserve.sampling_params import SamplingParams
from specserve.types import FatalEngineError
from tests.multimodal.tiny_vl import IMAGE_PAD, image_prompt, save_tiny_vl, tiny_vl
from tests.tiny_models import save_hf_folder, tiny_hf_model

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "specbench_sample.jsonl")
ENGINE = dict(max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=256, kv_cache_memory_bytes=64 << 20)
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
TINY_ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, block_size=8,
                   kv_cache_memory_bytes=8 << 20)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(pids, timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if _alive(pid)]


def _prefill_logits(llm: LLM, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [len(ids), vocab], greedy tokens [len(ids)]) of one prefill through the engine's model, in KV
    caches of its own (a tensor-parallel model's workers keep theirs apart from the engine's)."""
    model = llm.llm_engine.model
    blocks = -(-len(ids) // 16)
    caches = kv_caches(model.kv_cache_shape(blocks, 16), model.dtype, model.num_layers)
    meta = paged_metadata([len(ids)], [len(ids)], [list(range(blocks))], 16, kernel_usable(model.dtype))
    with torch.inference_mode():
        hidden, _ = model.forward(torch.tensor(ids), torch.arange(len(ids)), meta, caches)
        return model.compute_logits(hidden), model.greedy_tokens(hidden)


# ---- the split itself -------------------------------------------------------------------------------------
def _config(**overrides) -> DecoderConfig:
    fields = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152, rms_norm_eps=1e-5,
                  rope_theta=1e5, rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=True,
                  attention_bias=False, qk_norm=False)
    return DecoderConfig(**{**fields, **overrides})


def test_shards_split_attention_in_whole_kv_groups_and_pad_the_vocabulary():
    cfg = _config(vocab_size=49153)  # SmolLM2's heads; one more token than splits evenly
    first, second = TensorShard.create(cfg, 0, 2), TensorShard.create(cfg, 1, 2)
    assert (first.kv_heads, second.kv_heads) == ((0, 2), (2, 3))
    assert (first.q_heads, second.q_heads) == ((0, 6), (6, 9))
    assert (first.intermediate, second.intermediate) == ((0, 768), (768, 1536))
    assert first.vocab_shard_size == second.vocab_shard_size == 24577
    assert (first.vocab, second.vocab) == ((0, 24577), (24577, 49153))  # the second has one padding row
    layer = first.layer_config(cfg)
    assert (layer.num_attention_heads, layer.num_key_value_heads, layer.intermediate_size) == (6, 2, 768)


@pytest.mark.parametrize("overrides, size, names", [
    (dict(), 4, ["num_key_value_heads=3", "tensor_parallel_size=4"]),
    (dict(intermediate_size=1537), 2, ["intermediate_size=1537", "tensor_parallel_size=2"]),
    (dict(num_attention_heads=8), 2, ["num_attention_heads=8", "num_key_value_heads=3"]),
])
def test_sizes_that_do_not_split_raise_naming_them(overrides, size, names):
    with pytest.raises(ValueError) as err:
        check_divisible(_config(**overrides), size)
    assert all(name in str(err.value) for name in names), err.value


def test_split_argmax_is_torch_argmax():
    """Per-shard (max, argmax) pairs combine to the first maximum of the whole row, ties and NaN included."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (64, 40), generator=g).float()  # many ties, some across shards
    logits[3, 25] = float("nan")
    logits[5, :] = 7.0
    logits[6, 30:] = 9.0
    shard = 10
    pairs = []
    for start in range(0, 40, shard):
        part = logits[:, start:start + shard]
        index = part.argmax(-1, keepdim=True)
        pairs.append(torch.cat([part.gather(1, index).double(), (index + start).double()], dim=1))
    assert torch.equal(combine_argmax(torch.stack(pairs)), logits.argmax(-1))


# ---- SmolLM2 (the default model) ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference():
    """One process: the engine, and 4 Spec-Bench prompts (4 categories) with their greedy tokens. Tensor
    parallelism shards the GGUF's dequantized weights, so the reference keeps fp32 activations too."""
    llm = LLM(gguf_compute="fp32", **ENGINE)
    tok = llm.get_tokenizer()
    rows = [json.loads(line) for line in open(DATA)][::6]
    assert len({r["category"] for r in rows}) == 4
    prompts = [{"prompt_token_ids": tok.encode(tok.apply_chat_template([{"role": "user", "content": r["turns"][0]}]),
                                               add_special_tokens=False)} for r in rows]
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    return llm, prompts, tokens


@pytest.fixture(scope="module")
def tp2():
    return LLM(tensor_parallel_size=2, **ENGINE)


def test_greedy_tokens_equal_one_process(reference, tp2):
    _, prompts, tokens = reference
    assert tp2.llm_engine.model.tensor_parallel_size == 2
    assert [o.outputs[0].token_ids for o in tp2.generate(prompts, GREEDY, use_tqdm=False)] == tokens


@pytest.mark.parametrize("speculative_config", [
    {"method": "ngram", "num_speculative_tokens": 4},
    {"method": "suffix", "num_speculative_tokens": 4},
    {"method": "auto"},  # suffix, ngram and (fp32 shards) an int8 self-draft, run whole on the driver with its own KV
], ids=lambda c: c["method"])
def test_speculation_keeps_the_greedy_tokens(reference, speculative_config):
    """Drafts every step (the policy off): whether drafting pays depends on this host's step prices, which
    two ranks on two shared cores make a matter of chance; the tokens must not."""
    _, prompts, tokens = reference
    speculative_config = dict(speculative_config, adaptive_draft_length=False)
    llm = LLM(tensor_parallel_size=2, speculative_config=speculative_config,
              **dict(ENGINE, kv_cache_memory_bytes=160 << 20))  # auto: the draft's KV (all its heads) too
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == tokens
    assert llm.get_metrics().num_drafts > 0


def test_prefill_logits_within_1e4_of_one_process(reference, tp2):
    """The logits a prefill samples from (its last token's, over the whole vocabulary, gathered on the
    driver) differ from one process's by at most 1e-4: each all-reduce adds the ranks' partial sums of
    o_proj and down_proj, a different order of fp32 additions than one process's single sum, and the
    differences pass through 30 layers (logits here reach ~40 in size). The argmax is the same."""
    one, prompts, _ = reference
    for prompt in prompts:
        ids = prompt["prompt_token_ids"]
        (expected, greedy_one), (logits, greedy_two) = _prefill_logits(one, ids), _prefill_logits(tp2, ids)
        assert logits.shape == expected.shape == (len(ids), 49152)
        torch.testing.assert_close(logits[-1], expected[-1], atol=1e-4, rtol=0)
        assert torch.equal(greedy_two, logits.argmax(-1))  # the split argmax is the gathered logits' argmax
        assert greedy_two[-1] == greedy_one[-1]


def test_drafters_that_run_on_the_target_weights_are_refused():
    with pytest.raises(ValueError, match="'eagle3'.*tensor_parallel_size=2"):
        LLM(tensor_parallel_size=2, speculative_config={"method": "eagle3"}, **ENGINE)


def test_heads_that_do_not_split_fail_before_any_worker_starts():
    with pytest.raises(ValueError, match="num_key_value_heads=3.*use tensor_parallel_size <= 3"):
        LLM(tensor_parallel_size=4, **ENGINE)


def test_ray_actors_give_the_same_tokens(reference):
    ray = pytest.importorskip("ray")
    _, prompts, tokens = reference
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        llm = LLM(tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
        pids = list(llm.llm_engine.model.executor.worker_pids.values())
        assert [o.outputs[0].token_ids for o in llm.generate(prompts[:2], GREEDY, use_tqdm=False)] == tokens[:2]
        llm.llm_engine.model.shutdown()
        assert _wait_gone(pids) == []
    finally:
        ray.shutdown()


# ---- tiny models ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    """A Llama with q/k/v/o biases (o_proj's is added once, after the all-reduce), tied embeddings and an
    odd vocabulary (161: the second rank's slice ends in a padding row)."""
    model = tiny_hf_model("llama", tie=True, vocab_size=161, attention_bias=True)
    return save_hf_folder(model, tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> str:
    """A Qwen3: q/k RMSNorm per head (replicated), head_dim 32 set apart from hidden_size / heads."""
    return save_hf_folder(tiny_hf_model("qwen3", vocab_size=161), tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen3"])
def test_tiny_models_with_biases_norms_and_a_padded_vocabulary(family, request):
    folder = request.getfixturevalue(family)
    prompts = [[5, 9, 13, 77, 160, 2, 8], list(range(100, 140))]
    one = LLM(model=folder, **TINY_ENGINE)
    two = LLM(model=folder, tensor_parallel_size=2, **TINY_ENGINE)
    for ids in prompts:
        (expected, _), (logits, greedy) = _prefill_logits(one, ids), _prefill_logits(two, ids)
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(greedy, logits.argmax(-1))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    pids = list(two.llm_engine.model.executor.worker_pids.values())
    del two
    gc.collect()  # the engine holds reference cycles
    assert _wait_gone(pids) == [], "deleting the engine leaves its workers running"


def test_qwen2_vl_text_decoder_matches_one_process(tmp_path):
    """M-RoPE, QKV biases split with their rows, image embeddings from the driver's vision tower."""
    from PIL import Image
    import numpy as np

    folder = save_tiny_vl(tiny_vl("qwen2_vl"), tmp_path)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (84, 140, 3), dtype=np.uint8))
    prompts = [{"prompt_token_ids": image_prompt([[3, 4, 5, 6], [7, 8, 9]]), "multi_modal_data": {"image": image}},
               {"prompt_token_ids": [11, 12, 13, 14, 15, 16, 17, 18]}]
    engine = dict(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64, block_size=8,
                  kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    one = LLM(model=folder, **engine)
    two = LLM(model=folder, tensor_parallel_size=2, **engine)
    assert IMAGE_PAD in one.llm_engine.mm_processor.process(prompts[0]["prompt_token_ids"], {"image": image})[0]
    assert [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    (expected, _), (logits, _) = _prefill_logits(one, prompts[1]["prompt_token_ids"]), \
        _prefill_logits(two, prompts[1]["prompt_token_ids"])
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_a_killed_worker_is_reported_and_leaves_no_process(tiny_llama):
    llm = LLM(model=tiny_llama, tensor_parallel_size=2, **TINY_ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([[1, 2, 3]], params, use_tqdm=False)
    pid = llm.llm_engine.model.executor.worker_pids[1]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerFailure, match=r"worker rank 1 process \d+ was killed by signal SIGKILL"):
        llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert not _alive(pid)  # reaped, not a zombie
    with pytest.raises(WorkerFailure, match="has stopped"):  # and the engine stays stopped
        llm.generate([[4, 5, 6]], params, use_tqdm=False)


def test_an_error_on_the_driver_stops_the_workers(tiny_llama, monkeypatch):
    """The driver fails between broadcasting a command and joining its collective: the worker waits there
    for good, so it is stopped, and the engine refuses further steps."""
    llm = LLM(model=tiny_llama, tensor_parallel_size=2, **TINY_ENGINE)
    model = llm.llm_engine.model
    pids = list(model.executor.worker_pids.values())

    def fail(*args, **kwargs):
        raise MemoryError("simulated")

    monkeypatch.setattr(model.local, "greedy_tokens", fail)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with pytest.raises(FatalEngineError, match="a step failed on the driver.*simulated"):  # no in-process reset
        llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert _wait_gone(pids) == []
    with pytest.raises(RuntimeError, match="has stopped: a step failed on the driver"):
        llm.generate([[4, 5, 6]], params, use_tqdm=False)


@pytest.mark.parametrize("ending", ["exit", "SIGKILL"])
def test_no_worker_outlives_its_driver_process(tiny_llama, ending):
    script = textwrap.dedent(f"""
        import os, signal, sys
        from specserve.llm import LLM
        llm = LLM(model={tiny_llama!r}, tensor_parallel_size=2, max_model_len=128, block_size=8,
                  kv_cache_memory_bytes=8 << 20)
        print(*llm.llm_engine.model.executor.worker_pids.values(), flush=True)
        if {ending!r} == "SIGKILL":
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    pids = [int(p) for p in proc.stdout.split()]
    assert pids, proc.stderr
    assert _wait_gone(pids) == []
