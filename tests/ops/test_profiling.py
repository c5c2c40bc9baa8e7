"""The benchmarks' measuring helpers (specserve/ops/profiling.py): the machine's rates and the fused decoder
stack's profile counters."""
from __future__ import annotations

from specserve.llm import LLM
from specserve.ops import kernels, profiling
from specserve.sampling_params import SamplingParams
from tests.kernel_support import requires_c_kernels

pytestmark = requires_c_kernels


def test_machine_rates_are_measured():
    read, dots = profiling.machine_rates(1 << 20, repeats=2)
    assert read > 1e8  # bytes a second: any machine reads 1 MiB faster than in 10 ms
    assert (dots > 1e6) == ("avx512_vnni" in kernels.int8_paths())  # 0 without AVX512-VNNI


def test_the_decoder_profile_splits_a_forward(default_gguf_path):
    llm = LLM(model=default_gguf_path, max_num_seqs=1, max_model_len=256)
    assert llm.llm_engine.runner.model.fused_forward
    profiling.decoder_profile(reset=True)
    llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    parts = profiling.decoder_profile()
    assert set(parts) == set(profiling.DECODER_PROFILE_PARTS) and all(v > 0 for v in parts.values())
    assert parts["projections"] > parts["other_ops"]  # the GEMMs are most of a step
    assert profiling.decoder_profile() == dict.fromkeys(profiling.DECODER_PROFILE_PARTS, 0.0)  # read resets
    profiling.stop_decoder_profile()
    llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert profiling.decoder_profile() == dict.fromkeys(profiling.DECODER_PROFILE_PARTS, 0.0)  # off: nothing counted
    profiling.stop_decoder_profile()
