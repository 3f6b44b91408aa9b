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
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/weightq generate "The scheduler admits" "Café, Größe: 日本語 🎉"
	$(VENV)/bin/weightq sim --requests 500

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
