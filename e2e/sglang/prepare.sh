#!/usr/bin/env bash
# Prepare the "real SGLang on CPU" environment for the end-to-end tests.
#
#   bash e2e/sglang/prepare.sh
#
# Creates, under ${DPROUTER_SGLANG_HOME:-$HOME/.cache/dprouter-sglang}:
#   venv/         a separate Python 3.11 virtual environment with sglang 0.5.23,
#                 installed from the exact lock e2e/sglang/lock.txt (--no-deps: sglang's
#                 CUDA dependencies never come in; torch 2.13.0+cpu comes from the
#                 machine's local wheel folder via PIP_FIND_LINKS / pip.conf), then
#                 fixed in place by e2e/site_fixes.py
#   model-llama/  tiny random LlamaForCausalLM + WordLevel tokenizer  } e2e/sglang/
#   model-qwen3/  tiny random Qwen3ForCausalLM (for attention DP)     } make_models.py
#   cache/        every cache the install, the build and the servers use
#   logs/         server logs (written by e2e/sglang/server.py)
# The sgl_kernel stand-in is not copied: e2e/sglang/server.py puts
# e2e/sglang/ on the server's PYTHONPATH.
#
# Idempotent: each step leaves a marker holding a hash of its inputs and is
# skipped when the marker matches.  Non-interactive; uses pip only.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SGL_HOME="${DPROUTER_SGLANG_HOME:-$HOME/.cache/dprouter-sglang}"
VENV="$SGL_HOME/venv"
LOCK="$SCRIPT_DIR/lock.txt"
MAKE_MODELS="$SCRIPT_DIR/make_models.py"
MODELS=(llama qwen3)
PREPARE_NAME=sglang
# shellcheck source=e2e/prepare_lib.sh
source "$SCRIPT_DIR/../prepare_lib.sh"

begin_home "$SGL_HOME"
export TRITON_CACHE_DIR="$CACHE/triton"

# sglang's own metadata asks for CUDA packages; --no-deps keeps them out, and so must the lock
no_cuda_packages() {
    if "$1" -m pip list --format=freeze 2>/dev/null \
        | grep -iE '^(nvidia-|cuda-|flashinfer|sglang-kernel|sgl-kernel|sgl-deep-gemm)'; then
        echo "prepare.sh: CUDA packages got into $VENV (above); the lock must not list them" >&2
        exit 1
    fi
}

# Step 1: virtual environment + locked install.
locked_venv "$VENV" "$LOCK" no_cuda_packages

# Step 2: the fixes to the installed sglang / torchvision (fails loudly on a mismatch).
torchvision_imports() {
    "$1" -W ignore -c 'import torchvision.transforms' \
        || { echo "prepare.sh: torchvision still does not import" >&2; exit 1; }
}
site_fixed "$VENV" sglang torchvision_imports

# Step 3: the two tiny models (built together: they share one tokenizer).
model_key="$(hash_of "$MAKE_MODELS" "$venv_marker")"
models_ok=1
for m in "${MODELS[@]}"; do
    marker="$SGL_HOME/model-$m/.dprouter-built"
    marked "$marker" "$model_key" || models_ok=0
done
if ((models_ok)); then
    log "models: up to date (${MODELS[*]/#/model-} in $SGL_HOME), skipped"
else
    t0="$(now)"
    log "models: building ${MODELS[*]}"
    build="$SGL_HOME/models.tmp"
    rm -rf "$build"
    "$VENV/bin/python" "$MAKE_MODELS" "$build"
    for m in "${MODELS[@]}"; do
        rm -rf "$SGL_HOME/model-$m"
        mv "$build/model-$m" "$SGL_HOME/model-$m"
        echo "$model_key" >"$SGL_HOME/model-$m/.dprouter-built"
    done
    rm -rf "$build"
    log "models: done in $(took "$t0") s"
fi

log "ready in $(took "$total_start") s: $SGL_HOME ($(du -sh "$SGL_HOME" | cut -f1))"
