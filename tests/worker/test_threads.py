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


def test_exploring_backs_off_while_the_other_choice_stays_much_slower_and_resets_when_it_is_not():
    from specserve.worker.threads import MAX_EXPLORE_EVERY

    policy = ThreadPolicy(max_threads=2)

    def run(steps, seconds):
        two_threads = []
        for _ in range(steps):
            t = policy.choose(1)
            policy.record(1, t, seconds[t])
            two_threads.append(t == 2)
        return two_threads

    run(2, {1: 0.02, 2: 0.02})  # first steps: each choice measured (the very first is skipped)
    slow = run(4000, {1: 0.02, 2: 0.06})  # 2 threads 3x slower: 1 thread in use, explorations spread out
    gaps = [b - a for a, b in zip(*[[i for i, e in enumerate(slow) if e][j:] for j in (0, 1)])]
    assert gaps == sorted(gaps) and gaps[0] < gaps[-1] == MAX_EXPLORE_EVERY
    assert sum(slow) < 4000 / EXPLORE_EVERY / 2
    fast_again = run(3 * MAX_EXPLORE_EVERY, {1: 0.02, 2: 0.01})
    # the first exploration after the change is not slow: every 64 steps again until 2 threads take over
    assert fast_again[-EXPLORE_EVERY:].count(True) >= EXPLORE_EVERY - 1
