"""The counter-based uniforms behind seeded sampling: uniform on [0, 1), a function of (seed, position) only,
and unrelated across positions and across seeds."""
import numpy as np

from specserve.sample.keyed import keyed_uniform


def test_keyed_uniforms_are_uniform_and_repeatable():
    draws = np.array([keyed_uniform(seed, pos) for seed in range(200) for pos in range(100)])
    assert draws.min() >= 0.0 and draws.max() < 1.0
    counts = np.histogram(draws, bins=20, range=(0, 1))[0]
    expected = len(draws) / 20
    assert ((counts - expected) ** 2 / expected).sum() < 43.8  # chi-square, 19 degrees of freedom, p = 0.001
    assert keyed_uniform(7, 3) == keyed_uniform(7, 3) and keyed_uniform(2**64 + 7, 3) == keyed_uniform(7, 3)


def test_neighbouring_positions_and_seeds_are_uncorrelated():
    by_position = np.array([[keyed_uniform(seed, pos) for pos in range(2)] for seed in range(5000)])
    by_seed = np.array([[keyed_uniform(seed + d, 10) for d in range(2)] for seed in range(0, 10000, 2)])
    for pairs in (by_position, by_seed):
        assert abs(np.corrcoef(pairs[:, 0], pairs[:, 1])[0, 1]) < 0.06  # ~4 standard errors at n = 5000
