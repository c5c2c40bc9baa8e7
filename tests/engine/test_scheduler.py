"""Scheduler: FCFS, token budget, chunked prefill, preemption, drafts, stop conditions.

Pure Python: a fake runner stands in for the model (it samples only for requests whose scheduled tokens
reach the end of their tokens, and verifies drafts against a deterministic "target" token function), and
these tests never import torch.
"""
from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from specserve.engine.kv_cache_manager import KVCacheManager
from specserve.engine.request import Request, RequestStatus
from specserve.engine.scheduler import Scheduler, SchedulerConfig
from specserve.types import SchedulerOutput

EOS = 2
BS = 4


def make_scheduler(num_blocks: int = 64, block_size: int = BS, max_num_seqs: int = 8, budget: int = 64,
                   max_model_len: int = 256, caching: bool = True, lookahead: int = 0) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len, lookahead), kv)


def make_request(rid: str, prompt, max_tokens: int | None = None, min_tokens: int = 0,
                 ignore_eos: bool = False, stop_token_ids=None) -> Request:
    """prompt: a token list, or a length (tokens unique to this request, so no accidental prefix hits)."""
    if isinstance(prompt, int):
        base = 1000 * (sum(map(ord, rid)) % 997 + 1)
        prompt = [base + i for i in range(prompt)]
    params = SimpleNamespace(max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos,
                             stop_token_ids=stop_token_ids, num_speculative_tokens=None)
    return Request(rid, prompt, params, eos_token_ids=frozenset({EOS}))


def target_token(rid: str, position: int) -> int:
    """The token the fake target model emits at `position` of request `rid` (never EOS)."""
    return 100 + (sum(map(ord, rid)) * 31 + position * 17) % 89


def computed_before(out: SchedulerOutput) -> dict[str, int]:
    before = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
    before.update({c.req_id: c.num_computed_tokens for c in out.scheduled_cached_reqs})
    return before


class FakeRunner:
    """Samples only when a request's scheduled tokens reach the end of its tokens; verifies drafts greedily.

    `emit` overrides the target for chosen (rid, position) pairs, e.g. to produce EOS or a stop token.
    `propose(rid, request, next_position)` returns the drafts for the next step (or None).
    """

    def __init__(self, scheduler: Scheduler, propose=None, emit=None) -> None:
        self.scheduler = scheduler
        self.propose = propose
        self.emit = emit or {}

    def token(self, rid: str, position: int) -> int:
        return self.emit.get((rid, position), target_token(rid, position))

    def execute(self, out: SchedulerOutput) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        before = computed_before(out)
        sampled, drafts = {}, {}
        for rid in out.req_ids:
            request = self.scheduler.requests[rid]
            n, spec = out.num_scheduled_tokens[rid], out.scheduled_spec_decode_tokens.get(rid, [])
            num_tokens = request.num_tokens  # the runner's view: prompt + outputs, no drafts
            if before[rid] + n < num_tokens:
                assert not spec, "drafts scheduled for a request that does not reach its end"
                sampled[rid] = []
                continue
            assert before[rid] + n == num_tokens + len(spec)
            emitted = []
            for j, d in enumerate(spec):
                emitted.append(self.token(rid, num_tokens + j))
                if d != emitted[-1]:
                    break  # first mismatch: the target's token replaces the draft
            else:
                emitted.append(self.token(rid, num_tokens + len(spec)))  # all accepted: bonus token
            sampled[rid] = emitted
            if self.propose is not None:
                proposed = self.propose(rid, request, num_tokens + len(emitted))
                if proposed:
                    drafts[rid] = proposed
        return sampled, drafts

    def step(self, out: SchedulerOutput | None = None) -> tuple[SchedulerOutput, list[Request]]:
        out = self.scheduler.schedule() if out is None else out
        sampled, drafts = self.execute(out)
        return out, self.scheduler.update_from_output(out, sampled, drafts or None)


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 1000) -> dict[str, Request]:
    finished = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return finished
        for r in runner.step()[1]:
            assert r.request_id not in finished
            finished[r.request_id] = r
    raise AssertionError("requests did not finish")


def drafts_with(num_correct: int, num_drafts: int):
    """A proposer whose first num_correct drafts match the target and the rest do not."""
    def propose(rid, request, position):
        return [target_token(rid, position + j) + (0 if j < num_correct else 1000) for j in range(num_drafts)]
    return propose


# ---- module hygiene and validation ---------------------------------------------------------------

def test_import_does_not_pull_in_torch():
    code = ("import specserve.engine.scheduler, specserve.engine.kv_cache_manager, "
            "specserve.engine.request, sys; assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


@pytest.mark.parametrize("field", ["max_num_seqs", "max_num_batched_tokens", "max_model_len"])
def test_config_rejects_non_positive_limits(field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: 0})


def test_prompt_that_leaves_no_room_is_refused():
    sched = make_scheduler(max_model_len=16)
    for length in (16, 17):
        with pytest.raises(ValueError, match="max_model_len"):
            sched.add_request(make_request(f"r{length}", length))
    sched.add_request(make_request("ok", 15))  # one token of room is enough
    with pytest.raises(ValueError, match="at least one token"):
        sched.add_request(make_request("empty", []))
    assert list(sched.requests) == ["ok"]


def test_prompt_of_max_model_len_minus_one_generates_exactly_one_token():
    sched = make_scheduler(max_model_len=16, budget=4)
    req = make_request("a", 15, max_tokens=10)
    sched.add_request(req)
    finished = run_to_completion(sched, FakeRunner(sched))
    assert finished == {"a": req} and req.num_output_tokens == 1 and req.num_tokens == 16
    assert req.status == RequestStatus.FINISHED_LENGTH


def test_duplicate_request_id_is_refused():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("a", 5))
    assert len(sched.waiting) == 1


# ---- FCFS, budget, chunked prefill, max_num_seqs -------------------------------------------------

def test_fcfs_order_and_token_budget():
    sched = make_scheduler(budget=8)
    runner = FakeRunner(sched)
    for rid in ("r0", "r1", "r2"):
        sched.add_request(make_request(rid, 6, max_tokens=20, ignore_eos=True))
    out, _ = runner.step()
    assert out.req_ids == ["r0", "r1"]
    assert out.num_scheduled_tokens == {"r0": 6, "r1": 2}  # r1's prompt is chunked, r2 waits
    assert out.total_num_scheduled_tokens == 8
    assert [n.req_id for n in out.scheduled_new_reqs] == ["r0", "r1"]
    out, _ = runner.step()
    # Running requests first, in arrival order: r0 decodes, r1 continues its prefill, r2 gets the rest.
    assert out.req_ids == ["r0", "r1", "r2"]
    assert out.num_scheduled_tokens == {"r0": 1, "r1": 4, "r2": 3}
    assert [n.req_id for n in out.scheduled_new_reqs] == ["r2"]
    assert [c.req_id for c in out.scheduled_cached_reqs] == ["r0", "r1"]
    for _ in range(20):
        out, _ = runner.step()
        assert out.total_num_scheduled_tokens <= 8


def test_chunked_prefill_samples_only_when_the_prompt_completes():
    sched = make_scheduler(budget=8)
    runner = FakeRunner(sched)
    req = make_request("a", 25, max_tokens=3, ignore_eos=True)
    sched.add_request(req)
    expected_before = [0, 8, 16, 24]
    for step, n in enumerate([8, 8, 8, 1]):
        out = sched.schedule()
        assert out.num_scheduled_tokens == {"a": n}
        assert computed_before(out)["a"] == expected_before[step]
        if step == 0:
            assert out.scheduled_new_reqs[0].block_ids == sched.kv.get_block_ids("a") == [0, 1]
        else:
            assert out.scheduled_cached_reqs[0].num_computed_tokens == expected_before[step]
        assert req.num_computed_tokens == expected_before[step] + n
        sampled, _ = runner.execute(out)
        assert sampled["a"] == ([] if step < 3 else [target_token("a", 25)])
        sched.update_from_output(out, sampled)
    assert req.num_output_tokens == 1 and req.num_computed_tokens == req.num_tokens - 1 == 25
    assert len(sched.kv.get_block_ids("a")) == 7  # 25 tokens
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"a": 1}
    out, finished = runner.step()
    assert finished == [req] and req.output_token_ids == [target_token("a", 25 + i) for i in range(3)]


def test_max_num_seqs_limits_running_requests():
    sched = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(sched)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 4, max_tokens=2 + i, ignore_eos=True))
    seen_order = []
    while sched.has_unfinished_requests():
        out, _ = runner.step()
        assert len(out.req_ids) <= 2 and len(sched.running) <= 2
        seen_order.extend(n.req_id for n in out.scheduled_new_reqs)
    assert seen_order == ["r0", "r1", "r2", "r3", "r4"]


def test_waiting_request_blocked_by_memory_blocks_later_ones():
    """Strict FCFS: a small later request does not overtake a head request that does not fit."""
    sched = make_scheduler(num_blocks=4)
    runner = FakeRunner(sched)
    sched.add_request(make_request("big", 11, max_tokens=2, ignore_eos=True))  # 3 blocks, 12 tokens fit
    runner.step()
    sched.add_request(make_request("head", 8, max_tokens=1, ignore_eos=True))  # needs 2 blocks, 1 free
    sched.add_request(make_request("small", 2, max_tokens=1, ignore_eos=True))  # would fit in 1
    out = sched.schedule()
    assert out.req_ids == ["big"] and sched.kv.pool.num_free_blocks == 1
    _, finished = runner.step(out)
    assert [r.request_id for r in finished] == ["big"]
    out, _ = runner.step()
    assert out.req_ids == ["head", "small"]
    run_to_completion(sched, runner)


def test_prefix_hit_skips_the_cached_tokens():
    sched = make_scheduler(budget=64)
    runner = FakeRunner(sched)
    prefix = list(range(1, 17))
    a = make_request("a", prefix + [20], max_tokens=1)
    sched.add_request(a)
    runner.step()
    b = make_request("b", prefix + [30, 31], max_tokens=2)
    sched.add_request(b)
    out = sched.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 16 == b.num_cached_tokens
    assert out.num_scheduled_tokens == {"b": 2}
    assert out.scheduled_new_reqs[0].block_ids[:4] == [0, 1, 2, 3]  # a's blocks, still cached
    runner.step(out)
    assert b.num_output_tokens == 1 and b.num_computed_tokens == b.num_tokens - 1


# ---- preemption ----------------------------------------------------------------------------------

def test_out_of_blocks_preempts_the_newest_running_request():
    sched = make_scheduler(num_blocks=4, max_num_seqs=2)
    runner = FakeRunner(sched)
    r0 = make_request("r0", 8, max_tokens=3, ignore_eos=True)
    r1 = make_request("r1", 8, max_tokens=3, ignore_eos=True)
    r2 = make_request("r2", 3, max_tokens=1, ignore_eos=True)
    for r in (r0, r1, r2):
        sched.add_request(r)
    out, _ = runner.step()  # r0, r1 prefill (2 blocks each); r2 waits on max_num_seqs
    assert out.req_ids == ["r0", "r1"] and sched.kv.pool.num_free_blocks == 0
    r1_blocks = sched.kv.get_block_ids("r1")

    out, _ = runner.step()  # r0's 9th token needs a third block: r1 (newest) is preempted
    assert out.preempted_req_ids == {"r1"} and "r1" in out.finished_req_ids
    assert out.req_ids == ["r0"]
    assert r1.status == RequestStatus.PREEMPTED and r1.num_computed_tokens == 0
    assert r1.num_preemptions == 1 and sched.num_preemptions == 1
    assert r1.output_token_ids == [target_token("r1", 8)]  # its output survives the preemption
    assert [r.request_id for r in sched.waiting] == ["r1", "r2"]  # back at the front, ahead of r2
    assert sched.kv.get_block_ids("r0")[2] == r1_blocks[1]  # r1's tail block was reused first
    assert sched.get_stats().num_preemptions == 1

    finished = run_to_completion(sched, runner)
    assert set(finished) == {"r0", "r1", "r2"}
    for r in (r0, r1):
        assert r.output_token_ids == [target_token(r.request_id, 8 + i) for i in range(3)]
    assert sched.kv.pool.num_free_blocks == 4


def test_resumed_request_is_sent_as_new_with_its_outputs():
    sched = make_scheduler(num_blocks=4, max_num_seqs=2)
    runner = FakeRunner(sched)
    r0 = make_request("r0", 8, max_tokens=3, ignore_eos=True)
    r1 = make_request("r1", 8, max_tokens=3, ignore_eos=True)
    sched.add_request(r0)
    sched.add_request(r1)
    runner.step()
    out, _ = runner.step()
    assert out.preempted_req_ids == {"r1"}
    out, finished = runner.step()  # r0 finishes in this step, freeing its blocks
    assert out.req_ids == ["r0"]
    assert [r.request_id for r in finished] == ["r0"]
    out = sched.schedule()
    assert [n.req_id for n in out.scheduled_new_reqs] == ["r1"]
    new = out.scheduled_new_reqs[0]
    assert new.output_token_ids == r1.output_token_ids == [target_token("r1", 8)]
    assert new.prompt_token_ids == r1.prompt_token_ids
    assert new.block_ids == sched.kv.get_block_ids("r1")
    # Its first block was still cached, so it resumes after that prefix and recomputes the rest.
    assert new.num_computed_tokens == 4 and out.num_scheduled_tokens["r1"] == 5
    runner.step(out)
    assert r1.status == RequestStatus.RUNNING and r1.num_computed_tokens == r1.num_tokens - 1


def test_a_request_that_cannot_grow_preempts_itself_and_nothing_is_admitted():
    sched = make_scheduler(num_blocks=4, max_num_seqs=3)
    runner = FakeRunner(sched)
    r0 = make_request("r0", 7, max_tokens=4, ignore_eos=True)  # 2 blocks; 8 tokens still fit them
    r1 = make_request("r1", 8, max_tokens=4, ignore_eos=True)  # 2 blocks; its 9th token needs a third
    sched.add_request(r0)
    sched.add_request(r1)
    runner.step()
    sched.add_request(make_request("r2", 1, max_tokens=1, ignore_eos=True))
    out, _ = runner.step()
    assert out.preempted_req_ids == {"r1"} and out.req_ids == ["r0"]
    assert [r.request_id for r in sched.waiting] == ["r1", "r2"]  # nothing admitted this step
    finished = run_to_completion(sched, runner)
    assert set(finished) == {"r0", "r1", "r2"}
    assert sched.kv.pool.num_free_blocks == 4


# ---- speculative decoding ------------------------------------------------------------------------

def prefill_with_drafts(sched: Scheduler, runner: FakeRunner, rid: str, prompt_len: int, **kw) -> Request:
    req = make_request(rid, prompt_len, ignore_eos=True, **kw)
    sched.add_request(req)
    runner.step()
    return req


def test_drafts_are_scheduled_the_next_step():
    sched = make_scheduler()
    runner = FakeRunner(sched, propose=drafts_with(3, 3))
    req = prefill_with_drafts(sched, runner, "a", 5, max_tokens=50)
    drafts = [target_token("a", 6 + j) for j in range(3)]
    assert req.spec_token_ids == drafts
    assert req.num_tokens_with_spec == req.num_tokens + 3
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.scheduled_spec_decode_tokens == {"a": drafts}
    assert out.total_num_scheduled_tokens == 4
    assert len(sched.kv.get_block_ids("a")) * BS >= 6 + 3  # slots reserved for 1 + n tokens


@pytest.mark.parametrize("num_drafts", [1, 3, 5])
def test_rejected_drafts_roll_back_num_computed_tokens(num_drafts):
    for accepted in range(num_drafts + 1):
        sched = make_scheduler()
        runner = FakeRunner(sched, propose=drafts_with(accepted, num_drafts))
        req = prefill_with_drafts(sched, runner, "a", 5, max_tokens=50)
        num_tokens = req.num_tokens
        out = sched.schedule()
        assert req.num_computed_tokens == num_tokens + num_drafts  # advanced over all scheduled tokens
        sampled, drafts = runner.execute(out)
        assert len(sampled["a"]) == accepted + 1
        sched.update_from_output(out, sampled, drafts)
        assert req.num_tokens == num_tokens + accepted + 1
        assert req.num_computed_tokens == req.num_tokens - 1  # rolled back by num_drafts - accepted
        assert req.output_token_ids == [target_token("a", 5 + i) for i in range(req.num_output_tokens)]
        stats = req.spec_stats
        assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, num_drafts, accepted)
        assert stats.accepted_per_position == [1] * accepted + [0] * (num_drafts - accepted)


def test_spec_stats_add_up_over_many_steps():
    rng = random.Random(0)
    sched = make_scheduler()
    plan = []

    def propose(rid, request, position):
        n = rng.randrange(0, 5)
        a = rng.randrange(0, n + 1)
        drafts = [target_token(rid, position + j) + (0 if j < a else 1000) for j in range(n)]
        plan.append((n, a))
        return drafts

    runner = FakeRunner(sched, propose=propose)
    req = prefill_with_drafts(sched, runner, "a", 5, max_tokens=10_000)
    for _ in range(40):
        n, a = plan[-1]
        out, _ = runner.step()
        assert out.num_scheduled_tokens["a"] == 1 + n
        assert req.num_computed_tokens == req.num_tokens - 1
    verified = [(n, a) for n, a in plan[:-1] if n > 0]  # the last proposal is not verified yet
    stats = req.spec_stats
    assert stats.num_drafts == len(verified)
    assert stats.num_draft_tokens == sum(n for n, _ in verified)
    assert stats.num_accepted_tokens == sum(a for _, a in verified)
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    per_pos = stats.accepted_per_position
    assert all(per_pos[i] >= per_pos[i + 1] for i in range(len(per_pos) - 1))
    assert req.num_output_tokens == 1 + 40 + stats.num_accepted_tokens
    assert req.output_token_ids == [target_token("a", 5 + i) for i in range(req.num_output_tokens)]


def test_drafts_are_trimmed_to_max_tokens():
    sched = make_scheduler()
    runner = FakeRunner(sched, propose=drafts_with(5, 5))
    req = prefill_with_drafts(sched, runner, "a", 5, max_tokens=4)
    assert req.num_output_tokens == 1
    assert len(req.spec_token_ids) == 2  # 1 output + 2 drafts + 1 bonus = max_tokens
    out, finished = runner.step()
    assert out.num_scheduled_tokens == {"a": 3}
    assert finished == [req] and req.num_output_tokens == 4
    assert req.status == RequestStatus.FINISHED_LENGTH


def test_no_drafts_kept_when_one_token_is_left():
    sched = make_scheduler()
    runner = FakeRunner(sched, propose=drafts_with(3, 3))
    req = prefill_with_drafts(sched, runner, "a", 5, max_tokens=2)
    assert req.spec_token_ids == []
    out, finished = runner.step()
    assert out.scheduled_spec_decode_tokens == {} and finished == [req]


def test_drafts_are_trimmed_to_max_model_len():
    sched = make_scheduler(max_model_len=10)
    runner = FakeRunner(sched, propose=drafts_with(5, 5))
    req = prefill_with_drafts(sched, runner, "a", 7)  # no max_tokens: max_model_len decides
    assert req.num_tokens == 8 and len(req.spec_token_ids) == 1
    out, finished = runner.step()
    assert computed_before(out)["a"] + out.num_scheduled_tokens["a"] <= 10 - 1  # no KV at position >= 9
    assert finished == [req] and req.num_tokens == 10
    assert req.status == RequestStatus.FINISHED_LENGTH and req.status.finish_reason == "length"


def test_drafts_placed_past_max_model_len_are_not_scheduled():
    """Even drafts put on the request directly (not through update_from_output) are capped."""
    sched = make_scheduler(max_model_len=10)
    runner = FakeRunner(sched)
    req = prefill_with_drafts(sched, runner, "a", 7)
    req.spec_token_ids = [target_token("a", 8 + j) for j in range(5)]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 2}
    assert out.scheduled_spec_decode_tokens == {"a": req.spec_token_ids[:1]}
    _, finished = runner.step(out)
    assert finished == [req] and req.num_tokens == 10


def test_budget_cuts_drafts_and_the_rollback_still_holds():
    sched = make_scheduler(budget=3)
    runner = FakeRunner(sched, propose=drafts_with(5, 5))
    req = prefill_with_drafts(sched, runner, "a", 3, max_tokens=100)
    assert len(req.spec_token_ids) == 5
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"a": 3} and len(out.scheduled_spec_decode_tokens["a"]) == 2
    assert req.num_computed_tokens == req.num_tokens - 1
    assert req.spec_stats.num_draft_tokens == 2 and req.spec_stats.num_accepted_tokens == 2


def test_preemption_drops_pending_drafts():
    sched = make_scheduler(num_blocks=4, max_num_seqs=2)
    runner = FakeRunner(sched, propose=drafts_with(2, 2))
    r0 = make_request("r0", 7, max_tokens=6, ignore_eos=True)
    r1 = make_request("r1", 7, max_tokens=6, ignore_eos=True)
    sched.add_request(r0)
    sched.add_request(r1)
    runner.step()
    assert r1.spec_token_ids
    out, _ = runner.step()  # r0 needs 8 + 2 slots: a third block, taken from r1
    assert out.preempted_req_ids == {"r1"}
    assert r1.spec_token_ids == [] and r1.num_computed_tokens == 0
    finished = run_to_completion(sched, runner)
    for r in (r0, r1):
        assert finished[r.request_id].output_token_ids == [target_token(r.request_id, 7 + i) for i in range(6)]


def test_lookahead_slots_are_reserved():
    sched = make_scheduler(lookahead=3)
    runner = FakeRunner(sched)
    req = make_request("a", 8, max_tokens=5, ignore_eos=True)
    sched.add_request(req)
    runner.step()
    assert len(sched.kv.get_block_ids("a")) == 3  # 8 tokens + 3 lookahead slots
    sched.schedule()
    assert len(sched.kv.get_block_ids("a")) * BS >= req.num_computed_tokens + 3


def test_drafted_blocks_are_not_prefix_cached():
    sched = make_scheduler()
    wrong = drafts_with(0, 3)  # every draft rejected
    runner = FakeRunner(sched, propose=wrong)
    prompt = [1, 2, 3, 4]
    req = make_request("a", prompt, max_tokens=2, ignore_eos=True)
    sched.add_request(req)
    _, _ = runner.step()
    drafted = list(req.spec_token_ids)
    runner.step()  # tokens 4..7 fill block 1: one verified token and three (rejected) drafts
    assert req.is_finished
    probe = make_request("probe", prompt + [req.output_token_ids[0]] + drafted + [0])
    assert sched.kv.get_computed_blocks(probe)[1] == 4


# ---- stop conditions -----------------------------------------------------------------------------

def test_eos_stops_and_frees_blocks():
    sched = make_scheduler()
    runner = FakeRunner(sched, emit={("a", 7): EOS})
    req = make_request("a", 5)
    sched.add_request(req)
    finished = run_to_completion(sched, runner)
    assert finished["a"] is req and req.output_token_ids[-1] == EOS and req.num_output_tokens == 3
    assert req.status == RequestStatus.FINISHED_STOPPED and req.status.finish_reason == "stop"
    assert req.stop_reason is None
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks and "a" not in sched.requests
    assert "a" in sched.schedule().finished_req_ids  # the runner is told to drop its state
    assert sched.schedule().finished_req_ids == set()


def test_ignore_eos_keeps_going():
    sched = make_scheduler()
    runner = FakeRunner(sched, emit={("a", 6): EOS})
    req = make_request("a", 5, max_tokens=4, ignore_eos=True)
    sched.add_request(req)
    run_to_completion(sched, runner)
    assert req.num_output_tokens == 4 and EOS in req.output_token_ids
    assert req.status == RequestStatus.FINISHED_LENGTH


def test_stop_token_ids_set_stop_reason():
    sched = make_scheduler()
    runner = FakeRunner(sched, emit={("a", 6): 42})
    req = make_request("a", 5, max_tokens=10, ignore_eos=True, stop_token_ids=[42])
    sched.add_request(req)
    run_to_completion(sched, runner)
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == 42
    assert req.output_token_ids[-1] == 42 and req.num_output_tokens == 2


@pytest.mark.parametrize("token, reason", [(EOS, None), (42, 42)])
def test_a_stop_token_emitted_before_min_tokens_stops(token, reason):
    """The sampler masks EOS and stop ids before min_tokens unless nothing else is allowed (a grammar that has
    ended): one that is emitted anyway ends the request there, as in vLLM."""
    sched = make_scheduler()
    runner = FakeRunner(sched, emit={("a", 5): 7, ("a", 6): token})
    req = make_request("a", 5, max_tokens=10, min_tokens=5, stop_token_ids=[42])
    sched.add_request(req)
    run_to_completion(sched, runner)
    assert req.output_token_ids == [7, token]
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == reason


def test_max_tokens_finishes_with_length():
    sched = make_scheduler()
    runner = FakeRunner(sched)
    req = make_request("a", 5, max_tokens=4)
    sched.add_request(req)
    run_to_completion(sched, runner)
    assert req.num_output_tokens == 4 and req.status.finish_reason == "length"


def test_max_model_len_finishes_with_length():
    sched = make_scheduler(max_model_len=12)
    runner = FakeRunner(sched)
    req = make_request("a", 9)
    sched.add_request(req)
    run_to_completion(sched, runner)
    assert req.num_tokens == 12 and req.num_output_tokens == 3
    assert req.status == RequestStatus.FINISHED_LENGTH


def test_eos_among_accepted_drafts_drops_the_tokens_after_it():
    sched = make_scheduler()
    emit = {("a", 7): EOS}
    runner = FakeRunner(sched, propose=lambda rid, r, pos: [runner.token(rid, pos + j) for j in range(4)],
                        emit=emit)
    req = make_request("a", 5, max_tokens=50)
    sched.add_request(req)
    runner.step()  # output 5; drafts for positions 6..9 (7 is EOS), all "correct"
    _, finished = runner.step()
    assert finished == [req]
    assert req.output_token_ids == [runner.token("a", 5), runner.token("a", 6), EOS]
    assert req.spec_stats.num_accepted_tokens == 4  # acceptance is counted before the stop check


def test_max_tokens_among_accepted_drafts_truncates():
    sched = make_scheduler()
    runner = FakeRunner(sched, propose=drafts_with(4, 4))
    req = make_request("a", 5, max_tokens=3, ignore_eos=True)
    sched.add_request(req)
    runner.step()
    req.spec_token_ids = [target_token("a", 6 + j) for j in range(4)]  # more than _trim_drafts allows
    _, finished = runner.step()
    assert finished == [req] and req.num_output_tokens == 3


# ---- aborts --------------------------------------------------------------------------------------

def test_finish_requests_aborts_waiting_and_running_and_frees_blocks():
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(sched)
    running = make_request("run", 10, max_tokens=50)
    waiting = make_request("wait", 10, max_tokens=50)
    sched.add_request(running)
    sched.add_request(waiting)
    runner.step()
    assert sched.kv.pool.num_free_blocks < sched.kv.num_blocks
    sched.finish_requests("wait", RequestStatus.FINISHED_ABORTED)  # a single id
    sched.finish_requests(["run", "unknown", "wait"], RequestStatus.FINISHED_ABORTED)
    for r in (running, waiting):
        assert r.status == RequestStatus.FINISHED_ABORTED and r.status.finish_reason == "abort"
        assert r.request_id not in sched.requests
    assert not sched.running and not sched.waiting and not sched.has_unfinished_requests()
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks and sched.kv.req_blocks == {}
    out = sched.schedule()
    assert out.finished_req_ids == {"run", "wait"} and out.req_ids == []


def test_abort_during_a_step_is_ignored_by_update_from_output():
    sched = make_scheduler()
    runner = FakeRunner(sched)
    req = make_request("a", 5, max_tokens=5)
    sched.add_request(req)
    out = sched.schedule()
    sampled, _ = runner.execute(out)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(out, sampled) == []
    assert req.num_output_tokens == 0 and req.status == RequestStatus.FINISHED_ABORTED
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks


def test_abort_of_a_preempted_request():
    sched = make_scheduler(num_blocks=4, max_num_seqs=2)
    runner = FakeRunner(sched)
    sched.add_request(make_request("r0", 8, max_tokens=3, ignore_eos=True))
    sched.add_request(make_request("r1", 8, max_tokens=3, ignore_eos=True))
    runner.step()
    out, _ = runner.step()
    assert out.preempted_req_ids == {"r1"}
    sched.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in sched.waiting] == []
    run_to_completion(sched, runner)
    assert sched.kv.pool.num_free_blocks == 4


def test_stats_report_queue_lengths_and_usage():
    sched = make_scheduler(num_blocks=8, max_num_seqs=1)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 8, max_tokens=5))
    sched.add_request(make_request("b", 8, max_tokens=5))
    runner.step()
    stats = sched.get_stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert stats.kv_cache_usage == pytest.approx(2 / 8)


# ---- requests failed inside a step ---------------------------------------------------------------

def fail_in_step(sched: Scheduler, out: SchedulerOutput, runner: FakeRunner, failed: list[str]) -> list[str]:
    """What the engine does when the runner fails `failed` inside the step `out`: discard their step's KV, end
    them, then update the others. Returns the requests sent back to recompute."""
    sampled, _ = runner.execute(out)
    recomputing = sched.discard_step_kv(failed)
    sched.finish_requests(failed, RequestStatus.FINISHED_ERROR)
    sched.update_from_output(out, sampled)
    return recomputing


def test_a_failed_step_leaves_no_blocks_in_the_cache_and_its_readers_recompute():
    """a and b share a prompt and are admitted in one step; b hits the blocks a writes in it. a fails in the
    step: its blocks leave the prefix cache, and b recomputes from scratch, dropping its token of the step."""
    sched = make_scheduler(budget=64)
    runner = FakeRunner(sched)
    prompt = list(range(1, 18))  # four full blocks and one token
    a, b = make_request("a", prompt, max_tokens=3), make_request("b", prompt, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert b.num_cached_tokens == 16
    assert fail_in_step(sched, out, runner, ["a"]) == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_output_tokens == 0 and b.num_cached_tokens == -1
    assert [r.request_id for r in sched.waiting] == ["b"] and not sched.kv.pool.cached

    out = sched.schedule()
    assert out.finished_req_ids == {"a", "b"} and out.preempted_req_ids == {"b"}  # the runner drops b's state
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0 == b.num_cached_tokens  # no hit: b recomputes
    runner.step(out)
    finished = run_to_completion(sched, runner)
    assert finished["b"].output_token_ids == [target_token("b", 17 + i) for i in range(3)]
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks


def test_blocks_an_earlier_step_computed_stay_cached_and_their_readers_go_on():
    """a computed its prompt in an earlier step; b hits those blocks, and a fails in the next step: only the
    blocks that step wrote for a leave the cache, b keeps running."""
    sched = make_scheduler(budget=64)
    runner = FakeRunner(sched)
    prompt = list(range(1, 16))  # 15 tokens: a's decode step fills block 3 and caches it
    a, b = make_request("a", prompt, max_tokens=5), make_request("b", prompt[:12] + [40], max_tokens=3)
    sched.add_request(a)
    runner.step()
    sched.add_request(b)
    out = sched.schedule()
    assert b.num_cached_tokens == 12 and len(sched.kv.pool.cached) == 4
    assert fail_in_step(sched, out, runner, ["a"]) == []
    assert b.status == RequestStatus.RUNNING and b.num_output_tokens == 1
    assert len(sched.kv.pool.cached) == 3  # a's first three blocks, computed in the earlier step
    assert sched.kv.get_computed_blocks(make_request("c", prompt))[1] == 12


def test_a_reader_aborted_before_it_recomputes_is_reported_finished():
    sched = make_scheduler(budget=64)
    runner = FakeRunner(sched)
    prompt = list(range(1, 18))
    for rid in ("a", "b"):
        sched.add_request(make_request(rid, prompt, max_tokens=3))
    assert fail_in_step(sched, sched.schedule(), runner, ["a"]) == ["b"]
    sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    out = sched.schedule()
    assert out.finished_req_ids == {"a", "b"} and not out.preempted_req_ids  # the runner forgets b for good


# ---- randomized simulation -----------------------------------------------------------------------

def check_block_accounting(kv: KVCacheManager) -> None:
    refs = [0] * kv.num_blocks
    for blocks in kv.req_blocks.values():
        for b in blocks:
            refs[b.block_id] += 1
    free = set(kv.pool.free_queue)
    assert len(free) == len(kv.pool.free_queue)
    for block in kv.pool.blocks:
        assert block.ref_cnt == refs[block.block_id]
        assert (block.ref_cnt == 0) == (block.block_id in free)


class Simulation:
    """Random arrivals, lengths and max_tokens; a tiny block pool and budget; optional drafts and aborts."""

    def __init__(self, seed: int, speculate: bool, caching: bool) -> None:
        self.rng = rng = random.Random(seed * 4 + speculate * 2 + caching)
        self.max_model_len, self.num_blocks = 48, 13  # 13 blocks of 4: one max-length request, little else
        self.budget = rng.choice([5, 8, 16])
        self.max_num_seqs = rng.choice([3, 4, 6])
        self.sched = make_scheduler(num_blocks=self.num_blocks, max_num_seqs=self.max_num_seqs,
                                    budget=self.budget, max_model_len=self.max_model_len, caching=caching)
        self.runner = FakeRunner(self.sched, propose=self.propose if speculate else None)
        self.aborts = seed % 2 == 1
        self.arrivals = self.make_arrivals(40)
        self.everyone = {r.request_id: r for _, r in self.arrivals}
        self.finished: dict[str, Request] = {}
        self.aborted: set[str] = set()
        self.decoding: set[str] = set()  # sampled since its last (re)admission
        self.told_runner: set[str] = set()  # finished since the last schedule(): the runner must hear of it

    def make_arrivals(self, num_requests: int) -> list[tuple[int, Request]]:
        rng = self.rng
        prefixes = [[rng.randrange(1, 50) for _ in range(12)] for _ in range(3)]
        arrivals = []
        for i in range(num_requests):
            length = rng.randrange(1, 40)
            prompt = [rng.randrange(1, 50) for _ in range(length)]
            if rng.random() < 0.5:  # shared prefixes exercise the prefix cache
                prompt = (rng.choice(prefixes) + prompt)[:length]
            max_tokens = rng.randrange(1, self.max_model_len - length + 1)
            arrivals.append((rng.randrange(0, 60), make_request(f"r{i}", prompt, max_tokens, ignore_eos=True)))
        return sorted(arrivals, key=lambda a: a[0])

    def propose(self, rid: str, request: Request, position: int) -> list[int] | None:
        if self.rng.random() < 0.3:
            return None
        return [target_token(rid, position + j) + (0 if self.rng.random() < 0.7 else 1000)
                for j in range(self.rng.randrange(1, 6))]

    def run(self, max_steps: int = 5000) -> None:
        for step in range(max_steps):
            while self.arrivals and self.arrivals[0][0] <= step:
                self.sched.add_request(self.arrivals.pop(0)[1])
            if not self.arrivals and not self.sched.has_unfinished_requests():
                return
            out = self.sched.schedule()
            self.check_schedule(out)
            sampled, drafts = self.runner.execute(out)
            done = self.sched.update_from_output(out, sampled, drafts or None)
            self.decoding |= {rid for rid, tokens in sampled.items() if tokens}
            self.record_finished(done)
            if self.aborts and self.sched.running and self.rng.random() < 0.03:
                self.abort_one()
            self.check_after_step()
        raise AssertionError("simulation did not finish")

    def check_schedule(self, out: SchedulerOutput) -> None:
        sched, ids = self.sched, out.req_ids
        assert out.finished_req_ids - out.preempted_req_ids == self.told_runner
        self.told_runner = set()
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values()) <= self.budget
        assert len(ids) == len(set(ids)) and set(ids) == set(out.num_scheduled_tokens)
        assert len(ids) <= self.max_num_seqs and len(sched.running) <= self.max_num_seqs
        new_ids = {n.req_id for n in out.scheduled_new_reqs}
        assert sorted([*new_ids, *(c.req_id for c in out.scheduled_cached_reqs)]) == sorted(ids)
        assert not out.preempted_req_ids & set(ids) and not new_ids & self.decoding
        self.decoding -= out.preempted_req_ids
        for rid in out.preempted_req_ids:
            assert self.everyone[rid].status == RequestStatus.PREEMPTED
            assert self.everyone[rid].num_computed_tokens == 0
        before = computed_before(out)
        for rid in ids:
            req, n = sched.requests[rid], out.num_scheduled_tokens[rid]
            assert n > 0 and req.status == RequestStatus.RUNNING and req in sched.running
            assert before[rid] + n <= self.max_model_len - 1  # no KV at a position >= max_model_len - 1
            assert len(sched.kv.get_block_ids(rid)) * BS >= before[rid] + n
        assert not {r.request_id for r in sched.running} & {r.request_id for r in sched.waiting}
        check_block_accounting(sched.kv)

    def record_finished(self, done: list[Request]) -> None:
        for r in done:
            assert r.request_id not in self.finished and r.request_id not in self.aborted
            assert r.status == RequestStatus.FINISHED_LENGTH
            assert r not in self.sched.running and r.request_id not in self.sched.requests
            self.finished[r.request_id] = r
            self.told_runner.add(r.request_id)
            self.decoding.discard(r.request_id)

    def abort_one(self) -> None:
        victim = self.rng.choice(list(self.sched.running) + list(self.sched.waiting))
        self.sched.finish_requests(victim.request_id, RequestStatus.FINISHED_ABORTED)
        self.aborted.add(victim.request_id)
        self.told_runner.add(victim.request_id)
        self.decoding.discard(victim.request_id)

    def check_after_step(self) -> None:
        for r in self.sched.running:
            if r.request_id in self.decoding:
                assert r.num_computed_tokens == r.num_tokens - 1, r
                assert len(r.spec_token_ids) <= r.max_tokens - r.num_output_tokens - 1
                assert r.num_tokens + len(r.spec_token_ids) < self.max_model_len
            else:  # (re)prefilling
                assert r.num_computed_tokens < r.num_tokens and not r.spec_token_ids
        check_block_accounting(self.sched.kv)

    def check_end(self) -> None:
        sched, finished, aborted = self.sched, self.finished, self.aborted
        assert set(finished) | aborted == set(self.everyone) and not set(finished) & aborted
        for rid, r in finished.items():  # exactly max_tokens tokens, each at its position
            assert r.output_token_ids == [target_token(rid, r.num_prompt_tokens + i) for i in range(r.max_tokens)]
        for rid in aborted:
            r = self.everyone[rid]
            assert r.status == RequestStatus.FINISHED_ABORTED
            assert r.output_token_ids == [target_token(rid, r.num_prompt_tokens + i)
                                          for i in range(r.num_output_tokens)]
        assert sched.requests == {} and not sched.running and not sched.waiting
        assert sched.kv.pool.num_free_blocks == self.num_blocks and sched.kv.req_blocks == {}
        assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)


@pytest.mark.parametrize("caching", [True, False], ids=["cache", "nocache"])
@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "spec"])
@pytest.mark.parametrize("seed", range(4))
def test_randomized_simulation(seed, speculate, caching):
    sim = Simulation(seed, speculate, caching)
    sim.run()
    sim.check_end()
    assert sim.sched.num_preemptions > 0  # the pool is small enough that preemption must happen
    if speculate:
        assert sum(r.spec_stats.num_drafts for r in sim.everyone.values()) > 0
    if caching:
        assert sim.sched.kv.stats.hits > 0
