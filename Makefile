# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create .venv with pinned packages (constraints.txt) on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint slow e2e e2e-vllm e2e-sglang e2e-pd clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip==25.3
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test,dev,bench,tracing]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/dprouter demo

test: $(VENV)/.installed
	$(BIN)/pytest -m "not slow and not realvllm and not realsglang and not realpd"

slow: $(VENV)/.installed
	$(BIN)/pytest -m slow

# dprouter against real engines on the CPU (tiny local models): each prepares its own
# environment first (a separate venv, about 3 minutes each the first time)
e2e: e2e-vllm e2e-sglang e2e-pd

e2e-vllm: $(VENV)/.installed
	bash e2e/prepare.sh
	$(BIN)/pytest -m realvllm

e2e-sglang: $(VENV)/.installed
	bash e2e/sglang/prepare.sh
	$(BIN)/pytest -m realsglang

# prefill/decode pairs of both engines, the KV moving over Mooncake's TCP transport
e2e-pd: $(VENV)/.installed
	bash e2e/pd/prepare.sh
	$(BIN)/pytest -m realpd

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports  # the layers import downward only (pyproject.toml)

clean:
	rm -rf $(VENV)
