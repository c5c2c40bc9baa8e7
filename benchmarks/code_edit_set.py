"""Writes the code-editing prompt set (specserve/bench/data/code_edit.jsonl, Spec-Bench's JSONL form): each
prompt is a 50-90 line Python file of this repository at a fixed commit and one small change to make, the
answer the whole file rewritten, most of it copied from the prompt. The files are specserve's own code, so
the set carries no third-party text.

    .venv/bin/python benchmarks/code_edit_set.py   # then: specserve bench latency --dataset <that file> ...
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

COMMIT = "80fa345"  # the files as they were at this commit, whatever they are now
OUT = Path(__file__).resolve().parent.parent / "specserve" / "bench" / "data" / "code_edit.jsonl"
INSTRUCTION = ("Rewrite the following Python file with one change: {change} Change nothing else. Reply with the "
               "whole file in one ```python code block and nothing after it.\n\n```python\n{code}```")

EDITS = [  # (category, path, change)
    ("rename", "specserve/sample/spec_metadata.py",
     "rename the function `build_spec_decode_metadata` to `make_spec_decode_metadata`."),
    ("type_hints", "specserve/multimodal/chat.py",
     "give the function `_image` type hints for its parameters and its return value."),
    ("constant", "specserve/ops/hugepages.py",
     "make MIN_BYTES eight huge pages instead of four, and update its comment."),
    ("docstring", "specserve/engine/outputs.py",
     "add a one-line docstring to the class `Logprob`."),
    ("rename", "specserve/models/rope.py",
     "rename the parameter `scaling` to `rope_scaling` everywhere it appears."),
    ("bug_fix", "specserve/spec_decode/drafter_kv.py",
     "make `reset` also clear every per-request record the class keeps, if it does not already."),
    ("constant", "specserve/worker/calibration.py",
     "time each step size 5 times instead of 3 (CALIBRATION_REPEATS)."),
    ("logging", "specserve/models/openblas.py",
     "log a debug message with the thread count in `limit_openblas_threads` just before it returns."),
    ("type_hints", "specserve/spec_decode/draw.py",
     "replace `Callable` from typing with `collections.abc.Callable`."),
    ("docstring", "specserve/train/documents.py",
     "add a module docstring line saying the file has no third-party text, after the existing docstring."),
]


def file_at(path: str) -> str:
    return subprocess.run(["git", "show", f"{COMMIT}:{path}"], capture_output=True, text=True, check=True).stdout


def main() -> None:
    rows = []
    for i, (category, path, change) in enumerate(EDITS):
        code = file_at(path)
        lines = code.count("\n")
        if not 50 <= lines <= 90:
            raise SystemExit(f"{path}: {lines} lines at {COMMIT}, outside 50-90")
        rows.append({"question_id": 9000 + i, "category": f"code_edit_{category}", "source": f"{path}@{COMMIT}",
                     "turns": [INSTRUCTION.format(change=change, code=code)]})
    OUT.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{len(rows)} prompts -> {OUT}")


if __name__ == "__main__":
    main()
