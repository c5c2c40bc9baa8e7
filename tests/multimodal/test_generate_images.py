"""Prompts with images on tiny random Qwen2-VL / Qwen2.5-VL models, against transformers: positions, logits
through chunked prefill, greedy tokens batched with text-only prompts, prefix caching keyed on image content,
and bad input."""
import numpy as np
import pytest
import torch
from PIL import Image

from specserve.engine.kv_cache_manager import KVCacheManager
from specserve.engine.request import Request
from specserve.engine.scheduler import Scheduler, SchedulerConfig
from specserve.llm import LLM
from specserve.models.qwen2_vl import mrope_prompt_positions
from specserve.sampling_params import SamplingParams
from specserve.worker.model_runner import ModelRunner
from tests.multimodal.tiny_vl import IMAGE_PAD, image_prompt, save_tiny_vl, tiny_vl
from tests.tiny_models import save_hf_folder, tiny_hf_model

KINDS = ["qwen2_vl", "qwen2_5_vl"]
ENGINE = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64, block_size=8, kv_cache_memory_bytes=64 << 20)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


IMAGES = [noise_image(56, 56, 0), noise_image(140, 84, 1), noise_image(90, 200, 2), noise_image(300, 40, 3)]


@pytest.fixture(scope="module", params=KINDS)
def vl(request, tmp_path_factory):
    hf = tiny_vl(request.param)
    return hf, save_tiny_vl(hf, tmp_path_factory.mktemp(request.param))


def _prompts() -> list[dict]:
    """One image, two images, text only, and an image at the very start."""
    g = torch.Generator().manual_seed(5)

    def text(n):
        return torch.randint(3, 117, (n,), generator=g).tolist()

    return [
        {"prompt_token_ids": image_prompt([text(5), text(7)]), "multi_modal_data": {"image": IMAGES[1]}},
        {"prompt_token_ids": image_prompt([text(3), text(4), text(6)]),
         "multi_modal_data": {"image": [IMAGES[2], IMAGES[0]]}},
        {"prompt_token_ids": text(11)},
        {"prompt_token_ids": image_prompt([[], text(9)]), "multi_modal_data": {"image": [IMAGES[3]]}},
    ]


def _hf_inputs(llm: LLM, prompt: dict) -> dict:
    """transformers' inputs for the engine's expanded prompt: our preprocessed pixels and grids."""
    ids, features = llm.llm_engine.mm_processor.process(list(prompt["prompt_token_ids"]),
                                                        prompt.get("multi_modal_data"))
    inputs = {"input_ids": torch.tensor([ids])}
    if features:
        inputs.update(pixel_values=torch.from_numpy(np.concatenate([f.pixel_values for f in features])),
                      image_grid_thw=torch.tensor([f.grid_thw for f in features]),
                      mm_token_type_ids=(inputs["input_ids"] == IMAGE_PAD).int())
    return inputs


def _hf_generate(hf, inputs: dict, max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(**inputs, attention_mask=torch.ones_like(inputs["input_ids"]), do_sample=False,
                          max_new_tokens=max_new_tokens)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_prompt_positions_equal_transformers_rope_index(vl):
    hf, folder = vl
    llm = LLM(model=folder, **ENGINE)
    deltas = []
    for prompt in _prompts():
        inputs = _hf_inputs(llm, prompt)
        _, features = llm.llm_engine.mm_processor.process(list(prompt["prompt_token_ids"]),
                                                          prompt.get("multi_modal_data"))
        if not features:
            continue
        theirs, delta = hf.model.get_rope_index(inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"],
                                                image_grid_thw=inputs["image_grid_thw"])
        ours, our_delta = mrope_prompt_positions(inputs["input_ids"].shape[1], features, 2)
        assert torch.equal(ours, theirs[:, 0]) and our_delta == int(delta)
        deltas.append(our_delta)
    assert min(deltas) < 0 and max(deltas) <= 0  # images take no more positions than tokens


def test_logits_match_transformers_through_chunked_prefill_and_decode(vl):
    """Every prompt runs through the scheduler and runner with a 13-token budget, so prefill chunks cut
    through images; logits of each sampled position are within 1e-4 of transformers' full forward."""
    hf, folder = vl
    llm = LLM(model=folder, **ENGINE)
    engine = llm.llm_engine
    kv = KVCacheManager(num_blocks=256, block_size=4, enable_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=13, max_model_len=512), kv)
    runner = ModelRunner(engine.model, 4, eos_token_ids=set(), max_model_len=512)
    runner.initialize_kv_cache(256)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    inputs = {}
    for i, prompt in enumerate(_prompts()):
        ids, features = engine.mm_processor.process(list(prompt["prompt_token_ids"]), prompt.get("multi_modal_data"))
        sched.add_request(Request(str(i), ids, params, mm_features=features))
        inputs[str(i)] = _hf_inputs(llm, prompt)
    worst, cut_images = 0.0, 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        runner._update_states(out)
        for rid in out.req_ids:  # a chunk ending inside an image
            state, n = runner.requests[rid], out.num_scheduled_tokens[rid]
            cut_images += any(f.offset < state.num_computed_tokens + n < f.end for f in state.mm_features)
        batch = runner.prepare_inputs(out)
        with torch.inference_mode():
            hidden, _ = engine.model.forward(batch.input_ids, batch.positions, batch.attn, runner.kv_caches,
                                             batch.mm_embeds)
            logits = engine.model.compute_logits(hidden[batch.logits_indices])
        sampled = {}
        for row, rid in enumerate(batch.sample_req_ids):
            history = runner.requests[rid].token_ids
            ref_inputs = dict(inputs[rid], input_ids=torch.tensor([history]))
            if "mm_token_type_ids" in ref_inputs:
                ref_inputs["mm_token_type_ids"] = (ref_inputs["input_ids"] == IMAGE_PAD).int()
            with torch.no_grad():
                ref = hf(**ref_inputs).logits[0, -1].float()
            worst = max(worst, (logits[row] - ref).abs().max().item())
            sampled[rid] = [int(ref.argmax())]
            runner.requests[rid].append(sampled[rid])
        sched.update_from_output(out, {rid: sampled.get(rid, []) for rid in out.req_ids}, None)
    assert cut_images > 0
    assert worst < 1e-4, worst


def test_greedy_tokens_equal_transformers_generate_batched_with_text(vl):
    hf, folder = vl
    llm = LLM(model=folder, **dict(ENGINE, max_num_batched_tokens=24))  # chunks cut through images
    prompts = _prompts()
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.error is None
        assert out.outputs[0].token_ids == _hf_generate(hf, _hf_inputs(llm, prompt), GREEDY.max_tokens)


def test_prefix_cache_keys_on_image_content(vl):
    """The same tokens with another image never reuse the first image's KV; the same image does."""
    _, folder = vl
    text = list(range(3, 20))
    prompt = image_prompt([text, text[:5]])
    llm = LLM(model=folder, **ENGINE)
    first = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": IMAGES[1]}}, GREEDY,
                         use_tqdm=False)[0]
    other = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": IMAGES[2].resize((140, 84))}},
                         GREEDY, use_tqdm=False)[0]
    again = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": IMAGES[1]}}, GREEDY,
                         use_tqdm=False)[0]
    image_start = len(text) + 1
    assert other.prompt_token_ids == first.prompt_token_ids  # same placeholders, same length
    assert other.num_cached_tokens <= image_start  # only blocks before the image are shared
    assert again.num_cached_tokens > image_start + 8  # the same image's blocks are reused
    fresh = LLM(model=folder, **dict(ENGINE, enable_prefix_caching=False))
    alone = fresh.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": IMAGES[2].resize((140, 84))}},
                           GREEDY, use_tqdm=False)[0]
    assert other.outputs[0].token_ids == alone.outputs[0].token_ids
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_chat_with_image_parts_equals_generate_with_placeholders(vl):
    import base64
    import io

    _, folder = vl
    llm = LLM(model=folder, **ENGINE)
    png = io.BytesIO()
    IMAGES[1].save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "t5 t6"},
                                             {"type": "image_url", "image_url": {"url": url}},
                                             {"type": "image_pil", "image_pil": IMAGES[0]},
                                             {"type": "text", "text": "t9"}]}]
    chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    text = ("<|im_start|>user t5 t6<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|>"
            "<|vision_end|>t9<|im_end|> <|im_start|>assistant ")
    direct = llm.generate({"prompt_token_ids": tok.encode(text, add_special_tokens=False),
                           "multi_modal_data": {"image": [IMAGES[1], IMAGES[0]]}}, GREEDY, use_tqdm=False)[0]
    assert chat.prompt_token_ids == direct.prompt_token_ids
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]\.image_url\.url: .*remote"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}],
                 GREEDY, use_tqdm=False)


def test_skip_tokenizer_init_takes_token_ids(vl):
    _, folder = vl
    prompt = _prompts()[0]
    with_tok = LLM(model=folder, **ENGINE).generate(prompt, GREEDY, use_tqdm=False)[0]
    llm = LLM(model=folder, skip_tokenizer_init=True, **ENGINE)
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == with_tok.outputs[0].token_ids and out.outputs[0].text == ""
    bad = llm.generate("t1 t2", GREEDY, use_tqdm=False)[0]
    assert "skip_tokenizer_init" in bad.error


def test_bad_image_input_fails_alone(vl, tmp_path):
    """Each bad prompt gets an error naming the field; the good prompts of the same batch still run."""
    _, folder = vl
    llm = LLM(model=folder, limit_mm_per_prompt={"image": 2}, **ENGINE)
    good = _prompts()[0]
    one = image_prompt([[5], [6]])
    cases = {
        r"2 image\(s\) but the prompt holds 1": {"prompt_token_ids": one, "multi_modal_data": {"image": IMAGES[:2]}},
        r"1 image\(s\) but the prompt holds 2": {"prompt_token_ids": image_prompt([[5], [6], [7]]),
                                                "multi_modal_data": {"image": IMAGES[0]}},
        r"0 image\(s\) but the prompt holds 1": {"prompt_token_ids": one},
        r"limit_mm_per_prompt\['image'\] = 2": {"prompt_token_ids": image_prompt([[5], [6], [7], [8]]),
                                                "multi_modal_data": {"image": IMAGES[:3]}},
        r"multi_modal_data\.image\[0\]: ": {"prompt_token_ids": one, "multi_modal_data": {"image": b"not an image"}},
        r"multi_modal_data\.video is not supported": {"prompt_token_ids": one,
                                                      "multi_modal_data": {"video": IMAGES[0]}},
        r"max_model_len": {"prompt_token_ids": one, "multi_modal_data": {"image": noise_image(800, 800, 4)}},
        r"use one \(expanded by the engine\) or exactly 4": {
            "prompt_token_ids": [5, IMAGE_PAD, IMAGE_PAD, 6], "multi_modal_data": {"image": IMAGES[0]}},
    }
    outs = llm.generate([good, *cases.values(), good], GREEDY, use_tqdm=False)
    assert outs[0].error is None and outs[-1].error is None
    assert outs[0].outputs[0].token_ids == outs[-1].outputs[0].token_ids
    for pattern, out in zip(cases, outs[1:-1]):
        assert out.error is not None and __import__("re").search(pattern, out.error), (pattern, out.error)


def test_an_image_that_fails_to_encode_fails_its_request_alone(vl, monkeypatch):
    """The vision encoder raising on one image inside a step (chunked prefill, batched with others) ends that
    request with the error; the batch's other requests keep their tokens."""
    _, folder = vl
    llm = LLM(model=folder, enable_prefix_caching=False, **ENGINE)  # the second run encodes its images again
    prompts = _prompts()
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    model, encode = llm.llm_engine.model, llm.llm_engine.model.encode_image

    def failing_encode(pixel_values, grid_thw):
        if tuple(grid_thw) == llm.llm_engine.mm_processor.process(
                list(prompts[1]["prompt_token_ids"]), prompts[1]["multi_modal_data"])[1][0].grid_thw:
            raise ValueError("injected image fault")
        return encode(pixel_values, grid_thw)

    monkeypatch.setattr(model, "encode_image", failing_encode)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert outs[1].error is not None and "injected image fault" in outs[1].error and outs[1].error_from_input
    assert [o.outputs[0].token_ids for i, o in enumerate(outs) if i != 1] == reference[:1] + reference[2:]
    assert llm.get_metrics().num_engine_restarts == 0


def test_images_to_a_text_only_model_are_refused(tmp_path):
    folder = save_hf_folder(tiny_hf_model("qwen2"), tmp_path / "text")
    llm = LLM(model=folder, max_model_len=128)
    out = llm.generate({"prompt_token_ids": [5, 6], "multi_modal_data": {"image": IMAGES[0]}}, GREEDY,
                       use_tqdm=False)[0]
    assert "takes text only" in out.error


def test_preempted_image_requests_recompute_the_same_tokens(vl):
    """Too few KV blocks for the batch: requests are preempted and recomputed, images re-encoded, and
    the output is unchanged."""
    _, folder = vl
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    roomy = LLM(model=folder, **ENGINE).generate(prompts, params, use_tqdm=False)
    tight = LLM(model=folder, **dict(ENGINE, max_model_len=128, num_kv_blocks=20, enable_prefix_caching=False))
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.get_metrics().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]
