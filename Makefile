# kvyard: `make run` serves a local cluster of simulated workers; `make test` installs everything and runs the suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: install vllm sglang redis run test test-fast bench clean

$(BIN)/.installed: pyproject.toml setup.py router/_kvcore.c orchestrator/_relaycore.c
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]' --config-settings editable_mode=compat
	touch $@

install: $(BIN)/.installed

vllm:
	bash scripts/install_vllm.sh

sglang:
	bash scripts/install_sglang.sh

redis:
	bash scripts/ensure_redis.sh

run: install
	$(BIN)/kvyard up $(ARGS)

test: install vllm sglang redis
	bash scripts/install_browser.sh
	$(BIN)/pytest $(ARGS)

test-fast: install
	$(BIN)/pytest tests/unit $(ARGS)

clean:
	rm -rf $(VENV) .venv-vllm .venv-sglang .cache .kvyard
