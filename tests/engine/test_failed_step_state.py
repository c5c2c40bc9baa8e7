"""A request that fails inside a step leaves nothing behind (ARCHITECTURE invariant 9), on tiny random models:
no KV its failed step wrote stays in the prefix cache (a later identical request gets a fresh engine's tokens),
a request that read that KV in the same step recomputes, and a step that fails after some request finished in
it still ends every request it had in flight, with nothing left in the output processor."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("transformers", reason="the tiny random models come from transformers (pip install '.[test]')")

from specserve.llm import LLM  # noqa: E402
from specserve.sampling_params import SamplingParams  # noqa: E402
from tests.multimodal.tiny_vl import image_prompt, save_tiny_vl, tiny_vl  # noqa: E402
from tests.tiny_models import save_hf_folder, tiny_hf_model  # noqa: E402

# Prefix caching on (the default), prompts prefilled in chunks of CHUNK tokens, blocks of 8.
CHUNK = 32
ENGINE = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=CHUNK, block_size=8,
              kv_cache_memory_bytes=16 << 20)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
IMAGE = Image.fromarray(np.random.default_rng(1).integers(0, 256, (84, 140, 3), dtype=np.uint8))  # 15 placeholders


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory) -> str:
    return save_tiny_vl(tiny_vl("qwen2_vl"), tmp_path_factory.mktemp("tiny_vl"))


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory) -> str:
    return save_hf_folder(tiny_hf_model("llama"), tmp_path_factory.mktemp("tiny_llama"))


def _image_prompt(num_text_before: int) -> dict:
    """num_text_before text tokens, the image, then 10 more text tokens."""
    ids = image_prompt([list(range(3, 3 + num_text_before)), list(range(60, 70))])
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": IMAGE}}


def _fresh_tokens(folder: str, prompt, engine=ENGINE) -> list[int]:
    return LLM(model=folder, **engine).generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _fail_images(monkeypatch, model, fault: str, times: int = 10**9) -> None:
    """The first `times` images fail inside the step: in the vision encoder, or where their M-RoPE positions
    are built."""
    name = {"encode": "encode_image", "positions": "prompt_positions"}[fault]
    original, calls = getattr(model, name), []

    def failing(*args):
        calls.append(None)
        if len(calls) <= times:
            raise ValueError(f"injected {fault} fault")
        return original(*args)

    monkeypatch.setattr(model, name, failing)


@pytest.mark.parametrize("fault", ["encode", "positions"])
def test_a_failed_image_leaves_no_kv_of_its_step_in_the_prefix_cache(vl_folder, fault, monkeypatch):
    prompt = _image_prompt(5)  # the image in the first chunk: the failed step is the request's first
    expected = _fresh_tokens(vl_folder, prompt)
    llm = LLM(model=vl_folder, **ENGINE)
    with monkeypatch.context() as patch:
        _fail_images(patch, llm.llm_engine.model, fault)
        failed = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert failed.error is not None and f"injected {fault} fault" in failed.error
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == expected
    assert again.num_cached_tokens == 0  # nothing of the failed request was reused


def test_blocks_computed_before_the_failed_step_stay_cached(vl_folder, monkeypatch):
    """The first chunk (text only) succeeds, the second (the image) fails: the first chunk's blocks are sound
    and stay cached, the second's leave the cache."""
    prompt = _image_prompt(CHUNK + 4)
    expected = _fresh_tokens(vl_folder, prompt)
    llm = LLM(model=vl_folder, **ENGINE)
    with monkeypatch.context() as patch:
        _fail_images(patch, llm.llm_engine.model, "encode")
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].error is not None
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == expected
    assert again.num_cached_tokens == CHUNK


def test_a_request_that_read_the_failed_steps_kv_recomputes_it(vl_folder, monkeypatch):
    """Two identical prompts admitted in one step: the second hits the blocks the first writes in that step, and
    the first's image fails (once). The second recomputes them and gets a fresh engine's tokens."""
    roomy = dict(ENGINE, max_num_batched_tokens=2 * CHUNK)  # both prompts in one step
    prompt = _image_prompt(5)
    expected = _fresh_tokens(vl_folder, prompt, roomy)
    llm = LLM(model=vl_folder, **roomy)
    _fail_images(monkeypatch, llm.llm_engine.model, "encode", times=1)
    first, second = llm.generate([prompt, prompt], GREEDY, use_tqdm=False)
    assert first.error is not None and second.error is None
    assert second.outputs[0].token_ids == expected
    assert second.num_cached_tokens == 0  # what it reads in the end is its own recomputed KV
    assert not llm.llm_engine.has_unfinished_requests()


def _assert_nothing_left(engine) -> None:
    assert not engine.output_processor.parents and not engine.output_processor.child_to_parent
    assert not engine.scheduler.requests and not engine.runner.requests
    pool = engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_a_request_finished_in_a_failing_step_gets_a_terminal_output(text_folder, monkeypatch):
    """The fault comes after the scheduler freed a request that finished in the step, before its output was
    made: it still gets a terminal output (the step's error), and nothing of it is left."""
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12, 13]]
    reference = [o.outputs[0].token_ids for o in LLM(model=text_folder, **ENGINE).generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]
    llm = LLM(model=text_folder, **ENGINE)
    engine = llm.llm_engine
    update = engine.scheduler.update_from_output

    def update_then_fail(*args, **kwargs):
        finished = update(*args, **kwargs)
        assert [r.request_id for r in finished] == ["short"]
        raise RuntimeError("injected fault after a request finished")

    monkeypatch.setattr(engine.scheduler, "update_from_output", update_then_fail)  # gone with the reset
    engine.add_request("short", {"prompt_token_ids": prompts[0]}, SamplingParams(temperature=0.0, max_tokens=1))
    engine.add_request("long", {"prompt_token_ids": prompts[1]}, GREEDY)
    outputs = engine.step()
    assert sorted(o.request_id for o in outputs) == ["long", "short"]
    assert all(o.finished and "injected fault" in o.error for o in outputs)
    _assert_nothing_left(engine)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == reference


def test_a_final_output_made_before_the_fault_is_returned(text_folder, monkeypatch):
    """Two requests finish in one step; making the second's output fails after the first's final output was
    made (and forgotten by the output processor): the first still gets it, the second gets the step's error."""
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12, 13]]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    reference = [o.outputs[0].token_ids for o in LLM(model=text_folder, **ENGINE).generate(
        [{"prompt_token_ids": p} for p in prompts], one, use_tqdm=False)]
    llm = LLM(model=text_folder, **ENGINE)
    engine = llm.llm_engine
    make_output, faults = engine.output_processor.make_output, []

    def failing_once_for_b(parent_id):
        if parent_id == "b" and not faults:
            faults.append(parent_id)
            raise RuntimeError("injected output fault")
        return make_output(parent_id)

    monkeypatch.setattr(engine.output_processor, "make_output", failing_once_for_b)
    engine.add_request("a", {"prompt_token_ids": prompts[0]}, one)
    engine.add_request("b", {"prompt_token_ids": prompts[1]}, one)
    outputs = {o.request_id: o for o in engine.step()}
    assert faults == ["b"] and sorted(outputs) == ["a", "b"]
    assert outputs["a"].finished and outputs["a"].error is None
    assert outputs["a"].outputs[0].token_ids == reference[0]
    assert outputs["b"].finished and "injected output fault" in outputs["b"].error
    _assert_nothing_left(engine)
