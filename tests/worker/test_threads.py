import torch

from specserve.worker.threads import EXPLORE_EVERY, ThreadPolicy


def test_policy_measures_both_then_prefers_the_faster_and_keeps_exploring():
    policy = ThreadPolicy(max_threads=2)
    first = policy.choose(5)
    assert first == 2  # nothing measured yet: try all threads
    policy.record(5, 2, 9.0)  # the first step of a size (kernels being built) is not counted
    assert policy.choose(5) == 2
    policy.record(5, 2, 0.100)
    assert policy.choose(5) == 1  # then the other
    policy.record(5, 1, 0.050)
    picks = [policy.choose(5) for _ in range(3 * EXPLORE_EVERY)]
    assert picks.count(1) > picks.count(2) > 0  # mostly the faster, sometimes the other
    assert picks[:32].count(2) == 4  # early re-measurements (steps 4, 8, 16, 32 of the bucket) fix a bad first pick
    assert policy.choose(1) == 2 and policy.choose(500) == 2  # other buckets measure separately


def test_run_restores_the_thread_count():
    before = torch.get_num_threads()
    policy = ThreadPolicy()
    with policy.run(3):
        pass
    assert torch.get_num_threads() == before
