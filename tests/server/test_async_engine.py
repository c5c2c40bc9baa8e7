"""AsyncLLM over a fake engine: streaming, refusals, the waiting-queue bound, aborts, failure and shutdown, and
a request whose admission raises failing alone (in AsyncLLM and in a replica's loop)."""
from __future__ import annotations

import asyncio
import time

import pytest

from specserve.sampling_params import SamplingParams
from specserve.server.async_engine import (
    AsyncLLM, EngineDeadError, QueueFullError, RequestAbortedError, RequestFailedError)
from specserve.server.replicas.loop import ReplicaLoop
from specserve.server.replicas.protocol import AddCommand, ReplicaUpdate
from tests.server.fake_engine import FakeEngine


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


async def started(engine: FakeEngine, **kw) -> AsyncLLM:
    llm = AsyncLLM(engine, **kw)
    llm.start()
    return llm


async def collect(llm: AsyncLLM, request_id: str, max_tokens: int) -> list:
    return [out async for out in llm.generate(request_id, "hi", SamplingParams(max_tokens=max_tokens))]


def test_outputs_are_cumulative_and_end_finished():
    async def main():
        llm = await started(FakeEngine())
        outs = await collect(llm, "r", 5)
        await llm.shutdown()
        return outs

    outs = run(main())
    assert outs[-1].finished and outs[-1].outputs[0].text == "aaaaa"
    assert all(not o.finished for o in outs[:-1])
    assert [len(o.outputs[0].text) for o in outs] == sorted(len(o.outputs[0].text) for o in outs)


def test_concurrent_requests_each_get_their_own_output():
    async def main():
        llm = await started(FakeEngine(max_running=4))
        results = await asyncio.gather(*(collect(llm, f"r{i}", 3 + i % 4) for i in range(16)))
        await llm.shutdown()
        return results

    for i, outs in enumerate(run(main())):
        assert outs[-1].request_id == f"r{i}" and outs[-1].outputs[0].text == "a" * (3 + i % 4)


def test_engine_refusal_surfaces_from_add_request():
    async def main():
        llm = await started(FakeEngine())
        with pytest.raises(ValueError, match="prompt must not be empty"):
            await llm.add_request("r", "", SamplingParams())
        outs = await collect(llm, "r", 2)  # the id is free again and the engine still serves
        await llm.shutdown()
        return outs

    assert run(main())[-1].finished


def test_waiting_queue_bound_raises_queue_full():
    engine = FakeEngine(max_running=1)

    async def main():
        llm = await started(engine, max_waiting_requests=2)
        first = await llm.add_request("r0", "hi", SamplingParams(max_tokens=1000))
        engine.gate.clear()  # hold the engine inside its next step
        await asyncio.sleep(0.05)
        waiting = [asyncio.ensure_future(llm.add_request(f"r{i}", "hi", SamplingParams(max_tokens=2)))
                   for i in (1, 2)]
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFullError):
            await llm.add_request("r3", "hi", SamplingParams(max_tokens=2))
        engine.gate.set()
        llm.abort(first.request_id)
        streams = await asyncio.gather(*waiting)
        outs = [[o async for o in llm.outputs(s)] for s in streams]
        await llm.shutdown()
        return outs

    outs = run(main())
    assert all(o[-1].finished for o in outs)
    assert engine.aborted == ["r0"]


def test_leaving_the_stream_aborts_the_request():
    engine = FakeEngine()

    async def main():
        llm = await started(engine)
        stream = await llm.add_request("r", "hi", SamplingParams(max_tokens=10 ** 6))
        async for out in llm.outputs(stream):
            if len(out.outputs[0].text) >= 3:
                break
        deadline = time.monotonic() + 5
        while engine.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await llm.shutdown()
        return llm.snapshot

    snapshot = run(main())
    assert engine.aborted == ["r"] and not engine.requests
    assert snapshot.kv_cache_usage == 0 and snapshot.num_running == 0


def test_cancelled_consumer_aborts_the_request():
    engine = FakeEngine()

    async def main():
        llm = await started(engine)
        task = asyncio.ensure_future(collect(llm, "r", 10 ** 6))
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await llm.shutdown()

    run(main())
    assert engine.aborted == ["r"]


def test_shutdown_drains_then_aborts_what_is_left():
    engine = FakeEngine()

    async def main():
        llm = await started(engine)
        short = asyncio.ensure_future(collect(llm, "short", 3))
        endless = asyncio.ensure_future(collect(llm, "endless", 10 ** 6))
        await asyncio.sleep(0.05)
        await llm.shutdown(drain_timeout=0.3)
        with pytest.raises(EngineDeadError):
            await llm.add_request("late", "hi", SamplingParams())
        return await asyncio.gather(short, endless, return_exceptions=True), llm

    (short, endless), llm = run(main())
    assert short[-1].finished
    assert isinstance(endless, RequestAbortedError)
    assert engine.aborted == ["endless"] and not llm.is_running


def test_engine_failure_fails_in_flight_and_new_requests():
    engine = FakeEngine(fail_on_step=3)

    async def main():
        llm = await started(engine)
        with pytest.raises(EngineDeadError):
            await collect(llm, "r", 100)
        assert not llm.is_running
        with pytest.raises(EngineDeadError):
            await llm.add_request("r2", "hi", SamplingParams())
        await llm.shutdown()

    run(main())


class _FailingAdmission(FakeEngine):
    """A FakeEngine whose add_request raises something other than ValueError for prompts starting "raise"."""

    def add_request(self, request_id, prompt, params, arrival_time=None, grammar=None) -> None:
        if prompt.startswith("raise"):
            raise RecursionError("maximum recursion depth exceeded (injected)")
        super().add_request(request_id, prompt, params, arrival_time, grammar)


@pytest.mark.parametrize("stage", ["add", "compile"])
def test_any_exception_admitting_a_request_fails_that_request_alone(stage, monkeypatch):
    """Whatever admitting one request raises (here a RecursionError, as json.loads raises for a deeply nested
    schema), on the engine thread or while its grammar compiles, that request fails and the others go on."""
    engine = _FailingAdmission()

    def failing_compile(structured):
        raise RecursionError("maximum recursion depth exceeded (injected)")

    monkeypatch.setattr(engine, "compile_grammar", failing_compile)

    async def main():
        llm = await started(engine)
        running = asyncio.ensure_future(collect(llm, "running", 50))
        await asyncio.sleep(0.02)
        prompt, params = ("raise", SamplingParams()) if stage == "add" else ("hi", SamplingParams(
            structured_outputs={"regex": "a+"}))
        with pytest.raises(RequestFailedError, match="RecursionError") as failed:
            await asyncio.wait_for(llm.add_request("hostile", prompt, params), 5)
        later = await collect(llm, "later", 3)
        outs = await running
        assert llm.is_running
        await llm.shutdown()
        return failed.value, outs, later

    failed, outs, later = run(main())
    assert not failed.from_input
    assert outs[-1].outputs[0].text == "a" * 50 and later[-1].outputs[0].text == "aaa"


def test_a_replica_fails_a_request_whose_admission_raises_alone():
    """The replica loop's counterpart: the request is reported failed (the router answers 500), the loop goes on
    and serves the next request."""
    engine = _FailingAdmission()
    loop = ReplicaLoop(engine, send=lambda update: None)
    update = ReplicaUpdate()
    loop._apply(AddCommand("hostile", "raise", SamplingParams(), 0.0), update)
    loop._apply(AddCommand("next", "hi", SamplingParams(max_tokens=2), 0.0), update)
    assert [rid for rid, _ in update.failed] == ["hostile"] and "RecursionError" in update.failed[0][1]
    assert update.accepted == ["next"] and not update.refused
    assert engine.step()[0].request_id == "next"
