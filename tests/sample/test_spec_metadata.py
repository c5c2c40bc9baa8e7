from specserve.sample.spec_metadata import build_spec_decode_metadata


def test_worked_example_from_the_design():
    drafts = [[11, 12, 13], [], [21, 22], [], [31]]
    meta = build_spec_decode_metadata(drafts, [4, 104, 107, 207, 209])
    assert meta.logits_indices.tolist() == [0, 1, 2, 3, 103, 104, 105, 106, 206, 207, 208]
    assert meta.target_logits_indices.tolist() == [0, 1, 2, 5, 6, 9]
    assert meta.bonus_logits_indices.tolist() == [3, 4, 7, 8, 10]
    assert meta.num_draft_tokens == [3, 0, 2, 0, 1]
    assert meta.cu_num_draft_tokens.tolist() == [3, 3, 5, 5, 6]
    assert meta.draft_token_ids.tolist() == [11, 12, 13, 21, 22, 31]
    assert meta.max_spec_len == 3


def test_no_drafts_gives_one_logit_per_request():
    meta = build_spec_decode_metadata([[], []], [5, 6])
    assert meta.logits_indices.tolist() == [4, 5]
    assert meta.bonus_logits_indices.tolist() == [0, 1]
    assert meta.target_logits_indices.tolist() == []
