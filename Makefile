# Canzona: `make` bootstraps the environment; `make test` runs the quick suite, `make test-all` every test; `make demo` runs the main job
# (Qwen3-tiny, Muon with --canzona at TP 2 x DP 2 on 4 gloo processes); `make compare` trains it with
# AdamW, Muon, NorMuon, Shampoo and SOAP and plots the losses; `make plan` plans Qwen3-32B.
# First Python 3.12 interpreter that actually runs (pyenv shims may exist but refuse).
PYTHON_BOOT ?= $(shell for p in python3.12 $$(ls -d $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12 2>/dev/null); do $$p -c "import sys; assert sys.version_info[:2]==(3,12)" 2>/dev/null && { echo $$p; break; }; done)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: all venv test test-all test-unit test-multirank demo compare plan gpu-check clean

all: venv

venv: $(STAMP)

$(STAMP): requirements.txt requirements-test.txt setup.py
	@test -n "$(PYTHON_BOOT)" || { echo "error: Python 3.12 not found; install it or run 'make PYTHON_BOOT=/path/to/python3.12'"; exit 1; }
	test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r requirements-test.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# The quick suite (tests marked `quick`: every library module, one multi-process launch per
# parallelism, the demo's path; about 6 min on 2 cores); test-all: every test (CI runs it).
test: venv
	$(PY) -m pytest -q -m quick tests

# Three passes. The single-process tests (unit and integration) over both cores (pytest-xdist,
# a thread each). The multi-process launches two files at a time: a launch of gloo ranks on this
# machine leaves the cores idle 45% of its time (ranks waiting on loopback round trips, vmstat),
# which a second launch fills. Last, one at a time, the tests marked `alone` (pytest.ini): they
# time what they check (signals, deadlines, a stopped rank).
MULTI := tests/e2e tests/multirank tests/slurm
test-all: venv
	$(PY) -m pytest -q -n 2 tests/unit tests/integration; single=$$?; \
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not alone" $(MULTI); paired=$$?; \
	$(PY) -m pytest -q -m alone $(MULTI); alone=$$?; \
	test $$single -eq 0 -a $$paired -eq 0 -a $$alone -eq 0

demo: venv
	TP=2 PYTHON=$(abspath $(PY)) examples/qwen3/pretrain_qwen3_tiny_cpu.sh

# The demo's model and data trained with AdamW, then Muon (standard, gram Newton-Schulz, another seed),
# NorMuon (--optimizer adaptive_muon), Shampoo and SOAP under --canzona, same tokens and learning rate; plots the losses to build/compare/
# and prints a table (about 10 min on 2 cores).
compare: venv
	$(PY) tools/compare_optimizers.py

# Every GPU measurement in one command, on a machine with torch and a CUDA device, no network:
# the CUDA tests, Newton-Schulz benchmarks and calibration, TP 2 x DP 2 on CUDA against CPU,
# one-GPU Qwen3-8B runs; writes build/gpu-check/ and docs/gpu_check.md (docs/gpu_check.md says
# how to bring the packages to an offline machine). GPU_PYTHON: an interpreter with torch
# and megatron-core (default: the venv's, else python3).
GPU_PYTHON ?= $(shell test -x $(PY) && echo $(PY) || echo python3)
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHONPATH=$(CURDIR):$$PYTHONPATH $(GPU_PYTHON) tools/gpu_check.py $(GPU_CHECK_ARGS)

plan: venv
	$(PY) tools/plan.py --model qwen3-32b --tp 8 --dp 32 --compare --plot plan_qwen3-32b_tp8_dp32.png

clean:
	rm -rf $(VENV) build *.egg-info
