"""Image input through the chat endpoint: a tiny random Qwen2-VL served in process (uvicorn on a thread) with the
official `openai` client, against `LLM.chat` on the same folder; refused images are 400s naming the part."""
from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import uvicorn
from PIL import Image

from specserve.bench.common import free_port
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.server.api_server import add_serve_parser, build_app_from_args
from tests.multimodal.tiny_vl import save_tiny_vl, tiny_vl
from tests.tiny_models import tiny_hf_model

MAX_MODEL_LEN = 256
KV_BYTES = 16 << 20
LIMIT = {"image": 1}
# 112*112: a 224x224 image is shrunk to 4x4 merged patches, so the flag visibly reaches the engine.
PROCESSOR_KWARGS = {"max_pixels": 112 * 112}
MERGED_PATCH = 28  # patch 14 x merge 2: one placeholder token per 28x28 pixels


def png_url(width: int, height: int, seed: int = 0, media_type: str = "image/png") -> str:
    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return f"data:{media_type};base64," + base64.b64encode(buf.getvalue()).decode()


def image_chat(*urls: str, text: str = "t5 t6 t7") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url, "detail": "auto"}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@contextlib.contextmanager
def serve(*flags: str):
    """`specserve serve <flags>` built from its own argument parser, run by uvicorn on a thread; yields the
    base URL once the engine is up."""
    sub = argparse.ArgumentParser().add_subparsers()
    add_serve_parser(sub)
    args = sub.choices["serve"].parse_args(["--max-model-len", str(MAX_MODEL_LEN),
                                            "--kv-cache-memory-bytes", str(KV_BYTES), *flags])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app_from_args(args), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory) -> str:
    return save_tiny_vl(tiny_vl("qwen2_vl"), tmp_path_factory.mktemp("tiny_qwen2_vl"))


@pytest.fixture(scope="module")
def server(vl_folder):
    with serve("--model", vl_folder, "--served-model-name", "vl", "--limit-mm-per-prompt", json.dumps(LIMIT),
               "--mm-processor-kwargs", json.dumps(PROCESSOR_KWARGS)) as url:
        yield url


@pytest.fixture(scope="module")
def text_server(tmp_path_factory):
    """A text-only Qwen2 with the VL folder's tokenizer and template, so image parts render but cannot run."""
    folder = save_tiny_vl(tiny_hf_model("qwen2", vocab_size=128), tmp_path_factory.mktemp("tiny_qwen2"))
    with serve("--model", folder, "--served-model-name", "text") as url:
        yield url


@pytest.fixture(scope="module")
def reference(vl_folder) -> LLM:
    return LLM(model=vl_folder, max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_BYTES,
               limit_mm_per_prompt=LIMIT, mm_processor_kwargs=PROCESSOR_KWARGS)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


def reference_chat(reference: LLM, messages: list[dict]):
    return reference.chat(messages, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]


# ------------------------------------------------------------------------------------------- answers


def test_image_chat_matches_offline_llm_streamed_or_not(client, reference):
    messages = image_chat(png_url(56, 56))
    ref = reference_chat(reference, messages)
    whole = client.chat.completions.create(model="vl", messages=messages, temperature=0, max_tokens=8)
    assert whole.choices[0].message.content == ref.outputs[0].text
    assert whole.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert whole.usage.completion_tokens == len(ref.outputs[0].token_ids)
    chunks = list(client.chat.completions.create(model="vl", messages=messages, temperature=0, max_tokens=8,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)


def test_prompt_length_follows_image_size(client, reference):
    sizes = [(56, 56), (112, 84), (224, 224)]  # the last is capped by --mm-processor-kwargs max_pixels
    counts = []
    for width, height in sizes:
        messages = image_chat(png_url(width, height, seed=width))
        out = client.chat.completions.create(model="vl", messages=messages, temperature=0, max_tokens=1)
        assert out.usage.prompt_tokens == len(reference_chat(reference, messages).prompt_token_ids)
        counts.append(out.usage.prompt_tokens)
    side = int(PROCESSOR_KWARGS["max_pixels"] ** 0.5) // MERGED_PATCH
    merged = [(w // MERGED_PATCH) * (h // MERGED_PATCH) for w, h in sizes[:2]] + [side * side]
    assert [c - counts[0] for c in counts] == [m - merged[0] for m in merged]


def test_text_parts_only_keep_the_text_path(client, reference):
    messages = [{"role": "user", "content": [{"type": "text", "text": "t5"}, {"type": "text", "text": "t6"}]}]
    ref = reference_chat(reference, messages)
    out = client.chat.completions.create(model="vl", messages=messages, temperature=0, max_tokens=8)
    assert out.choices[0].message.content == ref.outputs[0].text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)


# ------------------------------------------------------------------------------------------- refusals


PNG_PREFIX = "data:image/png;base64,"
TRUNCATED_PNG = PNG_PREFIX + base64.b64encode(base64.b64decode(png_url(56, 56)[len(PNG_PREFIX):])[:120]).decode()
REFUSED = {
    "remote_url": (image_chat("https://example.com/cat.png"), "messages[0].content[0].image_url.url: remote"),
    "bad_base64": (image_chat("data:image/png;base64,iVBOR!!not*base64"), "invalid base64"),
    "truncated_png": (image_chat(TRUNCATED_PNG), "could not decode"),
    "gif": (image_chat(png_url(56, 56, media_type="image/gif")), "unsupported media type 'image/gif'"),
    "too_many": (image_chat(png_url(56, 56), png_url(56, 56, seed=1)), "limit_mm_per_prompt"),
    "unknown_part": ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "messages.0"),
}


def post_chat(url: str, model: str, messages: list[dict]) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=60,
                      json={"model": model, "messages": messages, "max_tokens": 4, "temperature": 0})


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_bad_images_are_400_naming_the_field(server, case):
    messages, expected = REFUSED[case]
    r = post_chat(server, "vl", messages)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages" and expected in error["message"], error


def test_image_to_text_only_model_is_400(text_server):
    r = post_chat(text_server, "text", image_chat(png_url(56, 56)))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages" and "text only" in error["message"], error
    assert post_chat(text_server, "text", [{"role": "user", "content": "t5 t6"}]).status_code == 200


def test_engine_undisturbed_after_refusals(server, client, reference):
    for messages, _ in REFUSED.values():
        assert post_chat(server, "vl", messages).status_code == 400
    messages = image_chat(png_url(112, 84, seed=7))
    out = client.chat.completions.create(model="vl", messages=messages, temperature=0, max_tokens=8)
    assert out.choices[0].message.content == reference_chat(reference, messages).outputs[0].text
    assert httpx.get(server + "/health").status_code == 200
