"""Numpy references for the sampling tests: distributions computed independently of specserve."""
import numpy as np

from specserve.sampling_params import SamplingParams


def ref_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The target in vLLM's order: temperature, min-p, top-k, then the smallest top set with mass >= p."""
    x = logits.astype(np.float64) / p.temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    keep = probs >= p.min_p * probs.max()
    order = np.argsort(-x)
    if p.top_k:
        keep[order[p.top_k:]] = False
    kept = np.where(keep, probs, 0.0)
    kept /= kept.sum()
    mass_before = np.cumsum(kept[order]) - kept[order]
    keep[order[mass_before >= p.top_p]] = False
    out = np.where(keep, probs, 0.0)
    return out / out.sum()
