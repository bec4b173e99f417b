# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create .venv with pinned packages (constraints.txt) on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint slow clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip==25.3
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test,dev]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/dprouter demo

test: $(VENV)/.installed
	$(BIN)/pytest -m "not slow"

slow: $(VENV)/.installed
	$(BIN)/pytest -m slow

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV)
