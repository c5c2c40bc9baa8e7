"""specserve: a speculative-decoding LLM inference engine shaped like vLLM v1, CPU first."""
import os

# OpenMP workers that spin while they wait destroy throughput when the machine's cores are shared
# (measured here: 16 tok/s passive vs 1.3 tok/s spinning at load 8 on 2 cores). Must be set before
# torch loads libgomp, so specserve sets it on import unless the user chose a policy.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):
    # Lazy, so `import specserve` stays light (the scheduler's tests import no torch).
    if name == "LLM":
        from specserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from specserve.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
