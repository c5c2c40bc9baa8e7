"""specserve: a speculative-decoding LLM inference engine shaped like vLLM v1, CPU first."""
import os

# OpenMP workers that spin while they wait destroy throughput when the machine's cores are shared
# (measured here: 16 tok/s passive vs 1.3 tok/s spinning at load 8 on 2 cores). Workers that sleep at
# once, though, are woken ~150 times per decode step (each linear layer and attention call is a
# parallel region), and on this VM that wake-up cost a 2-thread step 20-25 ms instead of ~18. So workers
# spin briefly (GOMP_SPINCOUNT 2000, tens of microseconds: the gap between two regions of one step),
# then sleep. Measured with a 135M model at batch 1: 17.6-17.9 ms per token on 2 threads with it, 20-25
# without; with another process busy on one core, 2 threads take 37-43 ms (passive: 23) and the runner's
# thread policy settles on one (20 ms). Both must be set before torch loads libgomp, so specserve sets
# them on import unless the user chose values.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "2000")

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "__version__"]


def __getattr__(name):
    # Lazy, so `import specserve` stays light (the scheduler's tests import no torch).
    if name == "LLM":
        from specserve.llm import LLM

        return LLM
    if name in ("SamplingParams", "StructuredOutputsParams"):
        from specserve import sampling_params

        return getattr(sampling_params, name)
    raise AttributeError(name)
