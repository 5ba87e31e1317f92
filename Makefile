# The two commands a newcomer runs: `make demo` and `make test`. Both set up .venv first if needed.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.setup-done
export VLLM_CPU_KVCACHE_SPACE ?= 1
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup lint test demo clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py scripts/setup_env.sh
	bash scripts/setup_env.sh

# ruff (vLLM's own linter and formatter, pinned in the test extra): lint and format checks before every test run
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# two workers (pytest-xdist), each taking whole modules, so a module's engines and checkpoints are built once
TEST_WORKERS ?= 2
test: lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

demo: $(STAMP)
	$(VENV)/bin/dsv4-mtp demo

clean:
	rm -rf $(VENV) build *.egg-info
