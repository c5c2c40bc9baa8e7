"""Counter-based uniforms: a seeded request's random draw at each output position is a function of (seed,
position) alone, so neither speculation, batch-mates nor the engine's history can change its tokens."""
from __future__ import annotations

_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    """SplitMix64's finaliser (Steele et al. 2014): a bijection of 64-bit ints that mixes every bit."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def keyed_uniform(seed: int, position: int) -> float:
    """U[0, 1) fixed by (seed, position) alone: a counter-based draw, so a seeded request's token at a
    position is the same whatever was drafted, verified or batched before it."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ position) >> 11) * 2.0 ** -53


def keyed_uniforms(seed: int, position: int, count: int) -> list[float]:
    """`count` independent keyed uniforms for one output position (one per level of sampler.tree_sample)."""
    return [keyed_uniform(seed, (position << 6) | level) for level in range(count)]


def tree_levels(vocab_size: int) -> int:
    """Levels of the binary tree over token ids that sampler.tree_sample descends."""
    return max(1, (vocab_size - 1).bit_length())
