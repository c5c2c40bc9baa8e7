from specserve.spec_decode.policy import (PROBE_EVERY, DraftLengthPolicy, best_num_drafts, expected_tokens)


def test_expected_tokens_matches_the_closed_form():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12


def test_draft_length_grows_with_acceptance_and_stops_when_it_does_not_pay():
    ks = [best_num_drafts(a, 8) for a in (0.02, 0.3, 0.6, 0.9, 1.0)]
    assert ks[0] == 0 and ks == sorted(ks) and ks[-1] == 8


def test_policy_backs_off_after_rejections_and_probes_again():
    policy = DraftLengthPolicy()
    assert policy.num_drafts("r", 6) > 0  # optimistic prior
    for _ in range(10):
        policy.record("r", 4, 0)
    decisions = [policy.num_drafts("r", 6) for _ in range(PROBE_EVERY)]
    assert decisions[:-1] == [0] * (PROBE_EVERY - 1) and decisions[-1] == 1
    for _ in range(10):
        policy.record("r", 1, 1)
    assert policy.num_drafts("r", 6) >= 4


def test_fixed_policy_always_drafts_k():
    policy = DraftLengthPolicy(adaptive=False)
    policy.record("r", 4, 0)
    assert policy.num_drafts("r", 5) == 5
