import pytest

from specserve.spec_decode.policy import (PROBE_EVERY, DraftOption, DraftPolicy, best_num_drafts, expected_tokens,
                                          probe_interval)


def test_expected_tokens_matches_the_closed_form():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12


def test_draft_length_grows_with_acceptance_and_stops_when_it_does_not_pay():
    ks = [best_num_drafts(a, 8) for a in (0.02, 0.3, 0.6, 0.9, 1.0)]
    assert ks[0] == 0 and ks == sorted(ks) and ks[-1] == 8


def test_policy_backs_off_after_rejections_and_probes_again():
    policy = DraftPolicy()
    assert policy.num_drafts("r", 6) > 0  # optimistic prior
    for _ in range(10):
        policy.record("r", 4, 0)
    decisions = [policy.num_drafts("r", 6) for _ in range(PROBE_EVERY)]
    assert decisions[:-1] == [0] * (PROBE_EVERY - 1) and decisions[-1] == 1
    for _ in range(10):
        policy.record("r", 1, 1)
    assert policy.num_drafts("r", 6) >= 4


def test_an_expensive_drafter_probes_less_often():
    """A draft model whose draft costs ~40% of a step probes about every 40 idle steps, so a request that
    does not accept enough pays ~1% for probing; prompt lookup keeps probing every PROBE_EVERY steps."""
    assert probe_interval(0.03) == PROBE_EVERY and probe_interval(0.4) == 40
    model = DraftOption("draft_model", 32, prior_drafting_cost=0.4)
    policy = _policy_with_measured_costs({n: 0.02 for n in range(1, 10)}, (model,))
    for _ in range(10):
        policy.record("r", 4, 0)
        policy.observe_drafting(4, 4 * 0.008)  # 0.4 of a 20 ms step per draft token, as its prior says
    decisions = [policy.num_drafts("r", 6) for _ in range(80)]
    assert [i for i, k in enumerate(decisions) if k] == [39, 79] and set(decisions) == {0, 1}


def test_new_requests_start_from_the_engines_acceptance_when_it_beats_the_prior():
    """A drafter costing 65% of a step does not pay at the prior's 60% acceptance, but does at the 85% its
    earlier requests showed; a poor engine rate changes nothing."""
    def policy_with_history(accepted_of_4):
        policy = _policy_with_measured_costs({n: 0.02 for n in range(1, 10)})
        policy.observe_drafting(4, 4 * 0.013)
        for _ in range(30):
            policy.record("old", 4, accepted_of_4)
        return policy

    good = policy_with_history(4)
    assert good.num_drafts("new", 4) > 0
    poor = policy_with_history(0)
    assert poor.engine_stats[0].rate < 0.1 and poor.num_drafts("new", 4) == 0
    assert poor.stats["new"][0].rate == pytest.approx(0.6)


def test_fixed_policy_always_drafts_k():
    policy = DraftPolicy(adaptive=False)
    policy.record("r", 4, 0)
    assert policy.num_drafts("r", 5) == 5


def _policy_with_measured_costs(costs: dict[int, float], options=(DraftOption("default", 32),)) -> DraftPolicy:
    policy = DraftPolicy(options)
    for _ in range(5):
        for num_tokens, seconds in costs.items():
            policy.observe_step(1, num_tokens, seconds)
    return policy


def test_measured_step_costs_replace_the_linear_prior():
    # as measured here: 2-6 tokens ~1.1x a one-token step, 7-9 tokens ~1.3x
    costs = {1: 0.0223, 2: 0.0235, 3: 0.0233, 4: 0.0240, 5: 0.0245, 6: 0.0242, 7: 0.0295, 8: 0.0301, 9: 0.0290}
    policy = _policy_with_measured_costs(costs)
    for _ in range(10):
        policy.record("r", 8, 4)  # accepts about 80% of drafts
    # the prior (3.5% per draft) would take all 8 drafts; the measured jump at 7 tokens caps it at 5
    assert best_num_drafts(policy.stats["r"][0].rate, 8) == 8
    assert policy.num_drafts("r", 8) == 5
    flat = _policy_with_measured_costs({n: 0.02 for n in range(1, 10)})
    for _ in range(10):
        flat.record("r", 8, 4)
    assert flat.num_drafts("r", 8) == 8


def test_unmeasured_sizes_and_batched_steps_use_the_prior():
    policy = _policy_with_measured_costs({1: 0.02, 6: 0.04})  # only k = 5 measured (2x)
    assert policy.step_costs.relative(5) == 2.0
    assert policy.step_costs.relative(3) == 1.0 + policy.cost_per_draft * 3
    policy.observe_step(4, 12, 0.05)  # a 4-request step: prior again, and it does not enter the table
    assert 12 not in policy.step_costs.seconds
    for _ in range(10):
        policy.record("r", 5, 5)
    assert policy.num_drafts("r", 5) == 5


def test_batched_steps_draft_only_while_the_step_is_not_compute_bound():
    def policy_after(step_seconds, num_requests):
        policy = DraftPolicy()
        for i in range(40):  # step sizes vary as drafts vary
            tokens = num_requests + (i * 7) % 25
            policy.observe_step(num_requests, tokens, step_seconds(tokens))
        policy.observe_step(num_requests, num_requests + 10, step_seconds(num_requests + 10))
        for _ in range(10):
            policy.record("r", 5, 4)  # ~80% acceptance
        return policy

    # 32 requests, compute-bound (time proportional to tokens): a draft costs a whole share; stop
    busy = policy_after(lambda n: 0.0016 * n, 32)
    assert busy.batch_fit.draft_cost(32) > 0.95
    assert busy.num_drafts("r", 5) == 0
    # 2 requests, memory-bound (a large fixed cost): drafts are cheap; draft fully
    light = policy_after(lambda n: 0.020 + 0.0005 * n, 2)
    assert light.batch_fit.draft_cost(2) < 0.1
    assert light.num_drafts("r", 5) == 5


def test_batch_fit_keeps_its_last_slope_when_steps_stop_varying():
    from specserve.spec_decode.step_pricing import LinearStepFit

    fit = LinearStepFit()
    for i in range(30):
        fit.observe(32 + i % 10, 0.001 * (32 + i % 10))
    slope = fit.fit[1]
    for i in range(200):  # drafting stopped: every step the same size, timings a little noisy
        fit.observe(32, 0.032 * (1 + 0.01 * (i % 3 - 1)))
    assert abs(fit.fit[1] - slope) < 0.1 * slope


def test_calibrated_batches_price_a_draft_row_until_live_steps_make_a_fit():
    """Calibrated steps of N requests adding one and two tokens each: a request's share of a plain step is
    interpolated between the calibrated N's, a draft token costs the nearest pair's difference per request
    (here half a request's row at 2, more at 16), and live steps of varied sizes take over."""
    from specserve.spec_decode.step_pricing import LinearStepFit

    fit = LinearStepFit()
    fit.seed({2: (0.004, 0.005), 8: (0.008, 0.0128)})
    assert fit.share(2) == pytest.approx(0.002) and fit.draft_cost(2) == pytest.approx(0.0005 / 0.002)
    assert fit.share(5) == pytest.approx(0.006 / 5)  # halfway between 2 and 8
    assert fit.share(16) == pytest.approx((0.008 + 0.0006 * 8) / 16)  # past 8: a draft row per request more
    assert fit.draft_cost(16) == pytest.approx(0.0006 / fit.share(16))
    price = (fit.share(16), fit.draft_cost(16))
    # steps alike in size: no fit, so the calibrated price holds and the policy need not reprice its tables
    assert [fit.observe(16, 0.0088) for _ in range(20)] == [False] * 20 and (fit.share(16), fit.draft_cost(16)) == price
    moved = [fit.observe(16 + i % 10, 0.004 + 0.0003 * (16 + i % 10)) for i in range(30)]
    assert fit.fit == (pytest.approx(0.004), pytest.approx(0.0003)) and moved[-1]
    assert fit.draft_cost(16) == pytest.approx(0.0003 / ((0.004 + 0.0003 * 16) / 16))


def test_a_calibrated_pair_timed_on_a_busy_moment_does_not_make_drafts_free():
    """At four requests the one-token step was timed slow (9.46 ms against 9.62 for two tokens each): a draft
    row's share of the step is taken as at least that at two requests, not 2%."""
    from specserve.spec_decode.step_pricing import LinearStepFit

    fit = LinearStepFit()
    fit.seed({2: (0.00695, 0.00937), 4: (0.00946, 0.00962), 8: (0.00994, 0.01634)})
    share_at_2 = (0.00937 - 0.00695) / 0.00695
    one, two = fit.calibrated[4]
    assert one == 0.00946 and (two - one) / one == pytest.approx(share_at_2)
    assert fit.draft_cost(4) == pytest.approx(share_at_2)  # a draft row against a request's share of the step
    assert fit.calibrated[8] == (0.00994, 0.01634)  # larger than the floor: as timed


def test_no_probing_when_a_draft_costs_a_whole_step_share():
    policy = DraftPolicy()
    for i in range(40):
        tokens = 32 + (i * 7) % 25
        policy.observe_step(32, tokens, 0.0016 * tokens)
    policy.observe_step(32, 32, 0.0016 * 32)
    for _ in range(10):
        policy.record("r", 4, 0)
    assert [policy.num_drafts("r", 5) for _ in range(3 * PROBE_EVERY)] == [0] * (3 * PROBE_EVERY)


def test_the_proposers_own_time_is_part_of_a_drafts_cost():
    """A draft model spends a forward pass per draft token: at 60% of a target step per token, half the
    drafts accepted no longer pays, nearly all still does; prompt lookup's fraction of a millisecond
    changes nothing."""
    flat = {n: 0.02 for n in range(1, 10)}
    for accepted, drafting, at_least, at_most in [(1, 0.0001, 1, 8), (1, 0.012, 0, 0), (7.9, 0.012, 4, 8)]:
        policy = _policy_with_measured_costs(flat)
        for _ in range(10):
            policy.record("r", 8, accepted)  # 1 accepted: 2 tried, a rate of 1/2
            policy.observe_drafting(8, 8 * drafting)
        assert at_least <= policy.num_drafts("r", 8) <= at_most
    batched = DraftPolicy()
    for tokens in range(4, 20):
        batched.observe_step(4, tokens, 0.02 + 0.0005 * tokens)
    for _ in range(10):
        batched.record("r", 8, 4)
    assert batched.num_drafts("r", 8) > 0
    batched.observe_drafting(8, 8 * 0.006)  # each draft token costs more than a request's share of a step
    assert batched.num_drafts("r", 8) == 0


def test_a_batched_draft_must_promise_a_clear_gain():
    """At 16 requests a draft whose expected gain is within the fit's noise (1.03x) is not made; one
    request with the same rate and relative cost drafts."""
    from specserve.spec_decode.policy import BATCH_MIN_GAIN, DraftOption, expected_tokens

    def policy_at(num_requests, per_draft):
        policy = DraftPolicy((DraftOption("x", 1),))
        policy.num_running = num_requests
        policy._verify_cost = lambda: (lambda k: 1.0 + per_draft * k)
        for _ in range(20):
            policy.record("r", 1, 1)
            policy.record("r", 1, 0)  # half accepted
        return policy

    rate = policy_at(16, 0.0).stats["r"][0].rate
    per_draft = expected_tokens(rate, 1) / 1.03 - 1.0  # a score of 1.03 at k = 1
    assert 1.0 < 1.03 < BATCH_MIN_GAIN
    assert policy_at(16, per_draft).num_drafts("r", 1) == 0
    single = DraftPolicy((DraftOption("x", 1),))
    single._verify_cost = lambda: (lambda k: 1.0 + per_draft * k)
    for _ in range(20):
        single.record("r", 1, 1)
        single.record("r", 1, 0)
    assert single.num_drafts("r", 1) == 1


def test_an_option_is_priced_at_the_drafts_it_usually_brings():
    """Two drafters accepted alike per position: one usually finds a single token (a lookup with short
    matches), the other brings the four asked for; the second ranks first."""
    from specserve.spec_decode.policy import DraftOption

    policy = DraftPolicy((DraftOption("short", 4), DraftOption("full", 4)))
    for _ in range(10):
        policy.record("r", 1, 1, option=0)  # one proposed, accepted
        policy.record("r", 4, 4, option=1)  # four proposed, accepted
    assert policy.stats["r"][0].usual_length(4) == 1 and policy.stats["r"][1].usual_length(4) == 4
    assert [option for option, _ in policy.plan("r", 4)] == [1, 0]


def test_one_request_that_always_drafts_gets_plain_steps_until_a_one_token_step_is_timed():
    from specserve.spec_decode.policy import CALIBRATE_EVERY

    policy = DraftPolicy()
    plain_steps = []
    for step in range(1, 8 * CALIBRATE_EVERY + 1):
        if not policy.drafts_this_step(1):
            plain_steps.append(step)
            policy.observe_step(1, 1, 0.02)  # the plain step is timed
    # the first one-token step of a size is not counted: four calibration steps give three samples
    assert plain_steps == [CALIBRATE_EVERY * j for j in range(1, 5)]


def test_step_costs_resist_a_slowed_step_and_never_price_more_drafts_below_fewer():
    from specserve.spec_decode.step_pricing import StepCosts

    costs = StepCosts()
    costs.seed({1: 1.0, 2: 1.1, 3: 1.5, 4: 1.4})  # size 4 timed below size 3: noise
    assert costs.relative(3) == costs.relative(2) == 1.5  # priced as the dearer smaller step
    costs.observe(1, 3.0)  # a calibrated size's first live step replaces the calibration only if quicker
    assert costs.seconds[1] == 1.0
    costs.observe(1, 3.0)  # a one-token step that other work on the host slowed threefold
    assert costs.seconds[1] == 1.0 + (1 - StepCosts.EMA) * StepCosts.CLIP  # moved 2%, not 40%
    for _ in range(60):  # a host that stays slower is followed
        costs.observe(1, 1.5)
    assert abs(costs.seconds[1] - 1.5) < 0.01


def test_no_planning_while_not_even_always_accepted_drafts_would_pay():
    """A drafter that costs more than a step per draft token (an int8 self-draft of a 4-bit target): no
    request gets a plan, a probe or per-request state; beside a lookup that is almost free, the lookup is
    still planned."""
    dear = DraftOption("draft_model", 4, prior_drafting_cost=1.2)
    policy = DraftPolicy((dear,))
    assert all(policy.plan("r", 4) == [] for _ in range(200)) and "r" not in policy.stats
    both = DraftPolicy((DraftOption("ngram", 4), dear))
    assert both.plan("r", 4)[0][0] == 0


def test_a_stalled_drafting_call_does_not_price_a_lookup_out():
    """One lookup call that a stall made 70 ms long (measured: a collector pause) moves its price a little;
    a price that a long slow spell did make prohibitive returns toward the prior while the option is not
    used, so the request drafts again."""
    policy = _policy_with_measured_costs({n: 0.005 * (1 + 0.03 * (n - 1)) for n in range(1, 10)})
    for _ in range(10):
        policy.record("r", 4, 2)
        policy.observe_drafting(4, 4 * 30e-6)
    policy.observe_drafting(2, 0.070)
    assert policy.draft_seconds[0] < 2 * 30e-6 and policy.num_drafts("r", 8) > 0
    for _ in range(80):  # drafting stays slow for a while: the price rises to more than a step per draft token
        policy.observe_drafting(4, 4 * 0.01)
    assert policy.draft_seconds[0] > 0.005 and policy.num_drafts("r", 8) == 0
    steps = []
    for step in range(400):
        policy.drafts_this_step(1)
        if policy.plan("r", 8) and policy.stats["r"][0].rate > 0.3:  # probes aside
            steps.append(step)
    assert steps and 50 < steps[0] < 300


def test_a_step_size_no_longer_used_returns_to_its_calibrated_cost():
    """A size timed slow while the host was busy, then never chosen again, is not priced from that moment
    for good: while other sizes are timed it returns to the calibrated shape."""
    from specserve.spec_decode.step_pricing import StepCosts

    costs = StepCosts()
    costs.seed({1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 1.4})
    for _ in range(40):
        costs.observe(5, 3.0)  # a busy moment on five-token steps
        costs.observe(1, 1.0)
    assert costs.relative(4) > 1.9
    for _ in range(300):
        costs.observe(1, 1.0)
        costs.observe(2, 1.1)
    assert costs.relative(4) == pytest.approx(1.4, abs=0.05) and costs.relative(1) == pytest.approx(1.1, abs=1e-6)


def _run_batch_one(policy: DraftPolicy, live_seconds, steps: int, rate: float = 0.7) -> list[int]:
    """`steps` steps of one request whose drafts are accepted at `rate`, each step timed by the injected clock
    live_seconds(tokens); the draft length of each step."""
    lengths, accepted_so_far = [], 0.0
    for _ in range(steps):
        k = policy.num_drafts("r", 4) if policy.drafts_this_step(1) else 0
        if k:
            accepted_so_far += rate * k
            accepted = min(k, int(accepted_so_far))
            accepted_so_far -= accepted
            policy.record("r", k, accepted)
        policy.observe_step(1, 1 + k, live_seconds(1 + k))
        lengths.append(k)
    return lengths


def test_a_calibration_taken_on_a_busy_moment_lets_drafting_start_once_steps_are_fast():
    """The calibration timed every multi-token step at three one-token steps (other work on the host);
    live steps cost 3% a draft token. A probe times a draft from the prior, the live time replaces the
    calibrated one, and the sizes no live step has timed are priced no dearer than those that were: the
    engine drafts within 64 steps, and by the end drafts the most it may."""
    policy = DraftPolicy((DraftOption("ngram", 4),))
    policy.seed_step_costs({1: 0.010, **{n: 0.030 for n in range(2, 6)}}, {})
    assert policy.num_drafts("r0", 4) == 0  # priced out by the calibration
    lengths = _run_batch_one(policy, lambda tokens: 0.010 * (1 + 0.03 * (tokens - 1)), 64)
    assert any(lengths[:32]) and lengths[-8:] == [4] * 8, lengths


def test_a_true_calibration_of_dear_drafts_keeps_them_off():
    """The same calibration, confirmed by the live steps (a draft row really costs two steps): after the probe
    that times it, drafting stays off but for a probe now and then."""
    policy = DraftPolicy((DraftOption("ngram", 4),))
    policy.seed_step_costs({1: 0.010, **{n: 0.010 + 0.020 * (n - 1) for n in range(2, 6)}}, {})
    lengths = _run_batch_one(policy, lambda tokens: 0.010 + 0.020 * (tokens - 1), 200)
    assert sum(1 for k in lengths if k) <= 200 // PROBE_EVERY + 1 and max(lengths) <= 1, lengths
