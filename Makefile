# The two commands of the README: `make run` and `make test`. Both install what they need into .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch must come from the CPU wheel: an unpinned or CUDA-index torch is a multi-GB download.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.installed

.PHONY: install run test lint bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --retries 0 "torch==2.13.0" --extra-index-url $(TORCH_INDEX)
	$(PY) -m pip install -q -e ".[dev]"
# HF's text-generation client pins huggingface-hub<1 while transformers 5 needs >=1.31; the client only
# imports build_hf_headers, which hub 1.x and 2.x keep, so it goes in without its pins (tests only).
	$(PY) -m pip install -q --no-deps "text-generation==0.7.0"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/weightq demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/weightq sim --json
	$(PY) -m bench.admission --json
	$(PY) -m bench.engine --json
	$(PY) -m bench.pipeline --json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
