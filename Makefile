# The two commands a newcomer runs: `make demo` and `make test`. Both set up .venv first if needed.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.setup-done
export VLLM_CPU_KVCACHE_SPACE ?= 1
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup test demo clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py scripts/setup_env.sh
	bash scripts/setup_env.sh

test: $(STAMP)
	$(PY) -m pytest tests

demo: $(STAMP)
	$(VENV)/bin/dsv4-mtp demo

clean:
	rm -rf $(VENV) build *.egg-info
