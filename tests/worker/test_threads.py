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
    # a clear verdict (2x) is re-checked once early (step 4 of the bucket), then from EXPLORE_EVERY on
    assert picks[:32].count(2) == 1
    assert policy.choose(500) == 2  # other buckets measure separately


def test_close_verdicts_are_re_measured_early():
    policy = ThreadPolicy(max_threads=2)
    for threads, seconds in ((2, 9.0), (2, 0.100), (1, 0.095)):  # 1 thread barely faster: not clear
        assert policy.choose(5) == threads
        policy.record(5, threads, seconds)
    picks = []
    for _ in range(29):
        picks.append(policy.choose(5))
        policy.record(5, picks[-1], 0.095 if picks[-1] == 1 else 0.100)
    assert [i + 4 for i, t in enumerate(picks) if t == 2] == [4, 8, 16, 32]


def test_new_sizes_borrow_a_clear_verdict_of_their_kind():
    """Once decode sizes agree that all threads are clearly faster, a new verification size does not spend
    steps on one thread before its EXPLORE_EVERY-th; a new prefill size still measures for itself."""
    policy = ThreadPolicy(max_threads=2)
    for _ in range(4):
        t = policy.choose(1)
        policy.record(1, t, 0.020 if t == 1 else 0.015)
    assert policy._clear_best(1) == 2
    picks = []
    for _ in range(EXPLORE_EVERY):
        picks.append(policy.choose(6))
        policy.record(6, picks[-1], 0.05)
    assert picks[:-1] == [2] * (EXPLORE_EVERY - 1) and picks[-1] == 1  # measured at step EXPLORE_EVERY
    picks = [policy.choose(200) for _ in range(3)]
    assert picks == [2, 2, 2]  # nothing recorded: the prefill bucket keeps asking for its first measurement
    policy.record(200, 2, 1.0)
    assert policy.choose(200) == 1


def test_long_steps_never_run_the_other_choice_to_measure_it():
    """A long prefill runs all threads until a short step of its bucket has measured one thread, then the
    faster of the two; the short steps keep the exploring schedule to themselves."""
    policy = ThreadPolicy(max_threads=2)
    for _ in range(5):
        assert policy.choose(2000) == 2
        policy.record(2000, 2, 0.5)
    assert policy.choose(100) == 1  # a short prefill measures one thread
    policy.record(100, 1, 0.100)  # 1 ms a token against 0.25: two threads stay
    assert policy.choose(2000) == 2
    policy = ThreadPolicy(max_threads=2)
    for threads, seconds in ((2, 0.2), (1, 0.05)):  # a host where one thread is much faster
        assert policy.choose(100) == threads
        policy.record(100, threads, seconds)
    policy.record(2000, 2, 5.0)
    assert [policy.choose(2000) for _ in range(EXPLORE_EVERY + 1)] == [1] * (EXPLORE_EVERY + 1)


def test_run_restores_the_thread_count():
    before = torch.get_num_threads()
    policy = ThreadPolicy()
    with policy.run(3) as threads:
        pass
    assert torch.get_num_threads() == before
    assert policy.runs == {threads: 1}  # steps run, by thread count


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


def test_a_clear_prefill_verdict_is_not_re_measured_early():
    """A 200-token prefill on the slower choice costs ~0.1 s here: once one thread measured clearly slower,
    prefills stay on all threads until EXPLORE_EVERY (a decode size would re-check at its step 4)."""
    policy = ThreadPolicy(max_threads=2)
    picks = []
    for _ in range(EXPLORE_EVERY):
        picks.append(policy.choose(200))
        policy.record(200, picks[-1], 0.26 if picks[-1] == 1 else 0.15)
    assert picks[:3] == [2, 1, 2] and picks[3:-1] == [2] * (EXPLORE_EVERY - 4) and picks[-1] == 1


def test_a_step_slowed_by_other_work_does_not_flip_the_choice_but_a_lasting_change_does():
    policy = ThreadPolicy(max_threads=2)
    policy.record(8, 2, 1.0)  # first step of the size: skipped
    policy.record(8, 2, 0.040)  # 5 ms a token on two threads
    policy.record(8, 1, 0.056)  # 7 ms on one
    policy.record(8, 2, 0.100)  # one two-thread step another process slowed 2.5x
    assert policy.choose(8) == 2  # counted as 25% slower at most: 5.75 ms, still below 7
    policy.record(8, 2, 0.036)  # a faster step is taken at once
    assert policy.seconds[(8, 2)] == 0.036 / 8
    for _ in range(12):  # two threads turn slower for good (another process holds a core)
        policy.record(8, 2, 0.080)
    assert policy.choose(8) == 1
