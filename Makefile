# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create .venv with pinned packages (constraints.txt) on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint slow e2e clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip==25.3
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test,dev,bench]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/dprouter demo

test: $(VENV)/.installed
	$(BIN)/pytest -m "not slow and not realvllm"

slow: $(VENV)/.installed
	$(BIN)/pytest -m slow

# dprouter against a real vLLM (CPU build, DP=2, tiny model): prepares its own
# environment first (a separate venv, about 2-3 minutes the first time)
e2e: $(VENV)/.installed
	bash e2e/prepare.sh
	$(BIN)/pytest -m realvllm

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV)
