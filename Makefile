# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create .venv with pinned packages (constraints.txt) on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint hooks slow e2e e2e-vllm e2e-sglang e2e-pd clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip==25.3
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test,dev,bench,tracing]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/dprouter demo

# with coverage (pyproject.toml [tool.coverage]): a report of the files not fully
# covered, and a floor that fails the run below it
test: $(VENV)/.installed
	$(BIN)/pytest --cov -m "not slow and not realvllm and not realsglang and not realpd"

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

# ruff, mypy, the import contract, and commit subjects of at most 72 characters (from
# 9a33515, the commit before that rule, on)
lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports  # the layers import downward only (pyproject.toml)
	git log --format=%s 9a33515..HEAD | awk 'length > 72 { print "subject over 72: " $$0; bad = 1 } END { exit bad }'

# ruff, ruff format and lint-imports on each commit, the subject's length on its message
# (.pre-commit-config.yaml: the tools of .venv, nothing fetched)
hooks: $(VENV)/.installed
	$(BIN)/pre-commit install

clean:
	rm -rf $(VENV)
