"""specserve: a speculative-decoding LLM inference engine shaped like vLLM v1, CPU first."""
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
