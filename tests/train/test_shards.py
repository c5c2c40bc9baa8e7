"""The shard format of self-synthesized data: an exact round trip, the loss mask, and the repetition loops
that end some answers (found against brute force, cut for training)."""
from __future__ import annotations

import os
import random

import numpy as np

from specserve.train.shards import Conversation, answer_spans, first_loop, loop_tail, read_conversations, read_shard, write_shard

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def conversation(r: random.Random, n: int) -> Conversation:
    ids = np.array([r.randrange(60000) for _ in range(n)], np.int64)
    mask = np.array([r.random() < 0.5 for _ in range(n)])
    return Conversation(ids, mask, {"users": [f"u{n}"], "source": "magpie", "note": "é"})


def test_shard_round_trip_is_exact(tmp_path):
    r = random.Random(2)
    convs = [conversation(r, n) for n in (1, 7, 300, 64)]
    path = str(tmp_path / "s.npz")
    write_shard(path, convs)
    back = read_shard(path)
    assert len(back) == 4
    for a, b in zip(convs, back):
        assert np.array_equal(a.token_ids, b.token_ids) and np.array_equal(a.assistant, b.assistant)
        assert a.meta == b.meta
    big = Conversation(np.array([70000, 3]), np.array([True, False]), {"users": []})
    write_shard(path, [big])
    assert read_shard(path)[0].token_ids.tolist() == [70000, 3]  # ids past uint16 keep their width


def test_loss_mask_counts_the_positions_that_predict_assistant_tokens():
    c = Conversation(np.arange(6), np.array([False, False, True, True, False, True]), {})
    assert c.loss_mask.tolist() == [False, True, True, False, True, False]


def brute_loop_tail(ids, max_period=128, min_run=32):
    """The definition, position by position: the longest exactly periodic tail of >= 3 periods' worth."""
    n, best = len(ids), None
    for p in range(1, max_period + 1):
        start = n - p
        while start - 1 >= 0 and start - 1 + p < n and ids[start - 1] == ids[start - 1 + p]:
            start -= 1
        run = n - p - start  # positions i >= p with ids[i] == ids[i - p], ending at the end
        if n // 3 >= p and run >= max(2 * p, min_run) and (best is None or run > best[1]):
            best = (p, run)
    return None if best is None else (n - best[1] - best[0], best[0])


def planted(r: random.Random, head: int, period: int, repeats: float) -> list[int]:
    unit = [r.randrange(50) for _ in range(period)]
    return [r.randrange(50) for _ in range(head)] + (unit * (int(repeats) + 1))[:int(period * repeats)]


def test_loop_tail_matches_its_definition_on_planted_and_random_loops():
    r = random.Random(5)
    cases = [planted(r, r.randrange(0, 80), r.randrange(1, 70), r.uniform(1.5, 8)) for _ in range(150)]
    cases += [[r.randrange(4) for _ in range(r.randrange(1, 200))] for _ in range(100)]  # small alphabets loop by chance
    found = 0
    for ids in cases:
        got = loop_tail(ids)
        assert got == brute_loop_tail(ids), ids
        found += got is not None
    assert found > 50
    ids = planted(random.Random(1), 40, 7, 10)
    start, period = loop_tail(ids)
    assert period == 7 and start <= 40  # the loop begins where the head stops (or earlier, by chance)


def test_first_loop_is_the_shortest_prefix_that_ends_in_a_loop():
    r = random.Random(6)
    cases = [planted(r, r.randrange(0, 80), r.randrange(1, 40), r.uniform(4, 8)) + [r.randrange(50) for _ in range(9)]
             for _ in range(60)]
    cases += [[r.randrange(3) for _ in range(r.randrange(1, 150))] for _ in range(60)]
    found = 0
    for ids in cases:
        expected = next((loop_tail(ids[:m]) + (m,) for m in range(1, len(ids) + 1) if loop_tail(ids[:m])), None)
        got = first_loop(ids)
        assert got == expected, ids
        if got is not None:
            found += 1
            assert first_loop(ids[:got[2]]) == got  # known as soon as the loop shows
    assert found > 40


def test_a_final_looping_answer_is_cut_after_two_periods_and_an_earlier_one_is_masked():
    r = random.Random(3)
    prompt1, answer1 = [1, 2, 3], [r.randrange(100, 200) for _ in range(20)] + [7, 8, 9, 10] * 20
    prompt2, answer2 = [4, 5], [r.randrange(100, 200) for _ in range(30)] + list(range(300, 340)) * 5
    ids = prompt1 + answer1 + prompt2 + answer2
    assistant = [False] * 3 + [True] * len(answer1) + [False] * 2 + [True] * len(answer2)
    c = Conversation(np.array(ids), np.array(assistant), {"users": ["a", "b"]})
    assert answer_spans(c.assistant) == [(3, 3 + len(answer1)), (5 + len(answer1), len(ids))]
    cut = c.without_loop_tails()
    a1, a2 = answer_spans(cut.assistant)
    assert a1 == (3, 3 + 20 + 8)  # 20 tokens of text, then two periods of 4
    assert a2 == (5 + len(answer1), 5 + len(answer1) + 30 + 80) and len(cut.token_ids) == a2[1]
    assert cut.token_ids.tolist() == ids[:a2[1]]  # the earlier loop stays as context
    plain = Conversation(np.array(prompt1 + answer1[:20]), np.array([False] * 3 + [True] * 20), {})
    same = plain.without_loop_tails()
    assert np.array_equal(same.token_ids, plain.token_ids) and np.array_equal(same.assistant, plain.assistant)


def test_the_shipped_data_loops_where_answers_hit_the_token_limit_or_were_stopped_there():
    """An answer of the shipped data that falls into a loop ran to the token limit (shards before
    stop_loops_from), was stopped within one check (16 tokens) of where its loop showed (finish "loop"), or
    rarely (a few in a hundred) left the loop and ended by itself."""
    convs = read_conversations(os.path.join(REPO, "data", "selfchat"))
    finish_of_loops, finished, stopped = [], 0, 0
    for c in convs:
        for (a, b), finish in zip(answer_spans(c.assistant), c.meta["finish"]):
            loop = first_loop(c.token_ids[a:b])
            if finish == "loop":
                stopped += 1
                assert loop is not None and loop[2] <= b - a < loop[2] + 16
            elif loop is not None:
                finish_of_loops.append(finish)
            finished += finish == "stop"
    assert finish_of_loops.count("length") > 50 and finished > 300 and stopped > 50
    assert set(finish_of_loops) <= {"length", "stop"} and finish_of_loops.count("stop") < 0.03 * finished
