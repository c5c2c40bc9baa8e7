"""Numpy references for the sampling tests: distributions computed independently of specserve."""
import numpy as np

from specserve.sampling_params import SamplingParams


def ref_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The target in vLLM's order: temperature, min-p, top-k, then the smallest top set with mass >= p.

    Ties are decided by value: a token tied with the least likely one top-k or top-p keeps stays too.
    """
    x = logits.astype(np.float64) / p.temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    keep = probs >= p.min_p * probs.max()
    order = np.argsort(-x, kind="stable")
    if p.top_k:
        keep &= x >= x[order[min(p.top_k, len(x)) - 1]]
    kept = np.where(keep, probs, 0.0)
    kept /= kept.sum()
    if p.top_p < 1:
        mass_before = np.cumsum(kept[order]) - kept[order]
        last_kept = order[max(np.count_nonzero(mass_before < p.top_p) - 1, 0)]
        keep &= x >= x[last_kept]
    out = np.where(keep, probs, 0.0)
    return out / out.sum()
