"""What every `specserve bench` command shares: Spec-Bench prompts in the model's chat template,
the transformers baseline, timing, the printed table and the JSON file.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

# Spec-Bench's 480 questions, shipped with the package (data/README.md: source and licence)
DEFAULT_DATASET = str(Path(__file__).with_name("data") / "specbench.jsonl")


# ---------------------------------------------------------------- prompts


@dataclass
class BenchPrompt:
    """One Spec-Bench question, rendered with the chat template and tokenized without extra specials."""

    question_id: Any
    category: str
    text: str
    token_ids: list[int]

    def as_engine_prompt(self) -> dict:
        return {"prompt": self.text, "prompt_token_ids": list(self.token_ids)}


def add_dataset_args(p: argparse.ArgumentParser, num_prompts: int = 32, max_tokens: int = 128) -> None:
    p.add_argument("--dataset", default=DEFAULT_DATASET,
                   help="Spec-Bench JSONL: one {'category', 'turns', ...} per line (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=num_prompts,
                   help="prompts taken round-robin over the categories (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=max_tokens,
                   help="new tokens per request; EOS is ignored so every run makes exactly this many")


def read_specbench(path: str | os.PathLike) -> list[dict]:
    """The dataset's rows, each checked to have a category and a non-empty first turn."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Spec-Bench dataset not found: {path} (pass --dataset)")
    rows = []
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{line_no}: not valid JSON ({e})") from e
        turns = row.get("turns")
        if not isinstance(row.get("category"), str) or not turns or not isinstance(turns[0], str):
            raise ValueError(f"{path}:{line_no}: expected a 'category' string and a non-empty 'turns' list")
        rows.append(row)
    return rows


def select_spread(rows: Sequence[dict], num: int) -> list[dict]:
    """`num` rows taken round-robin over the categories (in order of first appearance), each category's
    rows in file order: the same selection every run, and every category present once num >= #categories.
    """
    if num < 1:
        raise ValueError(f"the number of prompts must be >= 1, got {num}")
    if num > len(rows):
        raise ValueError(f"asked for {num} prompts but the dataset has only {len(rows)}")
    by_category: dict[str, list[dict]] = {}
    for row in rows:
        by_category.setdefault(row["category"], []).append(row)
    queues = list(by_category.values())
    picked: list[dict] = []
    for depth in range(max(len(q) for q in queues)):
        for queue in queues:
            if depth < len(queue):
                picked.append(queue[depth])
                if len(picked) == num:
                    return picked
    return picked


def evenly_spaced(items: Sequence, num: int) -> list:
    """`num` items at even strides through `items` (first one included)."""
    if not 0 <= num <= len(items):
        raise ValueError(f"cannot take {num} of {len(items)} items")
    return [items[i * len(items) // num] for i in range(num)]


def render_prompts(tokenizer, rows: Iterable[dict]) -> list[BenchPrompt]:
    """Each row's first turn as a one-message chat, ready for generation.

    tokenizer: anything with `apply_chat_template(messages, add_generation_prompt=True) -> str` and
    `encode(text, add_special_tokens=False) -> list[int]` (specserve's Tokenizer).
    """
    prompts = []
    for row in rows:
        text = tokenizer.apply_chat_template([{"role": "user", "content": row["turns"][0]}],
                                             add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        prompts.append(BenchPrompt(row.get("question_id"), row["category"], text, ids))
    return prompts


def load_bench_prompts(tokenizer, dataset: str | os.PathLike, num: int) -> list[BenchPrompt]:
    return render_prompts(tokenizer, select_spread(read_specbench(dataset), num))


def prompts_summary(prompts: Sequence[BenchPrompt]) -> list[dict]:
    return [{"question_id": p.question_id, "category": p.category, "num_prompt_tokens": len(p.token_ids)}
            for p in prompts]


# ---------------------------------------------------------------- timing


class Stopwatch:
    """`with Stopwatch() as sw: ...` then `sw.seconds` (wall clock, perf_counter)."""

    def __enter__(self) -> "Stopwatch":
        self.seconds = float("nan")
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._start


def median(values: Iterable[float]) -> float:
    values = [v for v in values if v == v]  # drop NaNs
    return statistics.median(values) if values else float("nan")


def safe_div(num: float, den: float) -> float:
    return num / den if den else float("nan")


def request_latencies(output) -> dict:
    """Time to first token and decode speed of one specserve RequestOutput, from its metrics."""
    m = output.metrics
    n = len(output.outputs[0].token_ids)
    ttft = m.first_token_time - m.arrival_time if m.first_token_time else float("nan")
    decode_s = m.last_token_time - m.first_token_time if m.last_token_time and m.first_token_time else 0.0
    return {"num_output_tokens": n, "ttft_s": ttft, "decode_s": decode_s,
            "decode_tokens_per_s": safe_div(n - 1, decode_s) if n > 1 else float("nan")}


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------- losslessness


def mismatch_exit_status(benchmark: str, mismatches: Sequence[str]) -> int:
    """The benchmark's exit status: 0 when every speculative output equals plain decoding's, else 1 after
    naming each mismatch on stderr. Greedy speculative decoding is lossless by design, so a mismatch is a bug
    to report, never a result to average into a table."""
    if not mismatches:
        return 0
    for line in mismatches:
        print(f"error: {line}", file=sys.stderr)
    print(f"error: specserve bench {benchmark}: {len(mismatches)} speculative output(s) differ from plain "
          f"decoding (exit status 1)", file=sys.stderr, flush=True)
    return 1


# ---------------------------------------------------------------- transformers baseline


def hf_torch_dtype(dtype: str):
    import torch

    return {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16}[dtype]


def load_hf_model(model_path: str, dtype: str = "auto"):
    """transformers' AutoModelForCausalLM for the same checkpoint specserve loads: a HF folder as is,
    a GGUF file through `gguf_file=` (transformers dequantizes it to `dtype`)."""
    from transformers import AutoModelForCausalLM

    path = os.fspath(model_path)
    kwargs = {"dtype": hf_torch_dtype(dtype)}
    if path.endswith(".gguf"):
        folder, kwargs["gguf_file"] = os.path.split(os.path.abspath(path))
    elif os.path.isdir(path):
        folder = path
    else:
        raise ValueError(f"{path}: expected a Hugging Face model folder or a .gguf file")
    return AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()


def hf_generate(model, batch: Sequence[Sequence[int]], max_tokens: int, pad_token_id: int) -> list[list[int]]:
    """Greedy `model.generate` over one left-padded batch, exactly `max_tokens` new tokens per row
    (min_new_tokens keeps EOS out, like ignore_eos); returns each row's new token ids."""
    import torch

    width = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)  # [batch, width]
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)  # [batch, width]
    for row, ids in enumerate(batch):
        input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, width - len(ids):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad_token_id)
    return out[:, width:].tolist()


# ---------------------------------------------------------------- environment, table, JSON


def package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def environment_info() -> dict:
    """What decides the numbers: threads, versions, CPU, and how busy the machine was."""
    import torch

    info = {"torch_num_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "cpu": _cpu_model(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "specserve": package_version("specserve"),
            "transformers": package_version("transformers")}
    if hasattr(os, "getloadavg"):
        info["load_average_1m"] = round(os.getloadavg()[0], 2)
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table: text columns left-aligned, numbers right-aligned, floats to 2 decimals
    (None prints as '-')."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(row[i], (int, float)) or row[i] is None for row in rows) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "nan" if value != value else f"{value:.2f}"
    return str(value)


def write_json(path: str | os.PathLike, payload: dict) -> Path:
    """Write `payload` (dataclasses allowed; NaN becomes null) to `path`, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(payload), indent=2) + "\n")
    return path


def _jsonable(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return _jsonable(asdict(value))
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None
    return value


# ---------------------------------------------------------------- fidelity

def teacher_forced_logits(model, tokens):
    """Logits [T, vocab] of one prefill of `tokens` (int64 [T]) through a fresh paged cache of `model`."""
    import torch

    from specserve.ops import kernels
    from specserve.ops.attention import build_attention_metadata, kv_caches

    block = 16
    blocks = list(range(-(-len(tokens) // block)))
    caches = kv_caches(model.kv_cache_shape(len(blocks), block), torch.float32, model.num_layers)
    meta = build_attention_metadata([len(tokens)], [len(tokens)], [blocks], block, torch.arange(len(tokens)),
                                    kernels.kernel_usable(torch.float32))
    with torch.inference_mode():
        hidden, _ = model.forward(tokens, torch.arange(len(tokens)), meta, caches)
        return model.compute_logits(hidden)


def free_port() -> int:
    """A loopback TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """An HTTP server command in a subprocess on a free loopback port (`port_flag PORT` appended), its output in
    a temporary log file; `url` is its base URL once GET /health answers 200. A context manager that stops it."""

    def __init__(self, cmd: list[str], port_flag: str = "--port", log_prefix: str = "server-",
                 env: dict | None = None, startup_timeout_s: float = 300) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=log_prefix, suffix=".log", delete=False)
        self.proc = subprocess.Popen([*cmd, port_flag, str(self.port)], stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env)
        self._wait_healthy(startup_timeout_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} ({self.log.name}):\n"
                                   f"{self.log_text()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        log = self.log_text()  # before stop() closes the log file
        self.stop()
        raise RuntimeError(f"the server was not healthy after {timeout_s:.0f} s ({self.log.name}):\n{log[-4000:]}")

    def log_text(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then SIGKILL if it has not exited after `timeout` seconds; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
