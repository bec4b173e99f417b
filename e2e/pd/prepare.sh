#!/usr/bin/env bash
# Prepare the "real prefill/decode pairs on CPU" environment for the end-to-end tests.
#
#   bash e2e/pd/prepare.sh
#
# Both engines' own environments first (e2e/prepare.sh, e2e/sglang/prepare.sh: each
# also applies its P/D fix, e2e/site_fixes.py), then, under
# ${DPROUTER_PD_HOME:-$HOME/.cache/dprouter-pd}:
#   mooncake/   Mooncake's transfer engine (the non-CUDA wheel), pip --no-deps --target:
#               put on the engines' PYTHONPATH, never installed into their venvs
#   debs/       Debian's libibverbs1, libnl-3-200 and libnl-route-3-200 unpacked without
#               root (apt-get download + dpkg-deb -x), for LD_LIBRARY_PATH; skipped when
#               the system already has them (.ci/run installs them with apt-get)
#   logs/       engine logs (written by e2e/pd/pair.py)
# The KV then moves over Mooncake's TCP transport (MC_FORCE_TCP=1, set by e2e/pd/pair.py).
#
# Idempotent: each step leaves a marker holding a hash of its inputs and is skipped when
# the marker matches.  Non-interactive.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PD_HOME="${DPROUTER_PD_HOME:-$HOME/.cache/dprouter-pd}"
MOONCAKE="mooncake-transfer-engine-non-cuda==0.3.13.post1"
LIBS=(libibverbs1 libnl-3-200 libnl-route-3-200)
VLLM_PYTHON="${DPROUTER_VLLM_HOME:-$HOME/.cache/dprouter-vllm}/venv/bin/python"
SGLANG_PYTHON="${DPROUTER_SGLANG_HOME:-$HOME/.cache/dprouter-sglang}/venv/bin/python"
PREPARE_NAME=pd

bash "$SCRIPT_DIR/../prepare.sh"
bash "$SCRIPT_DIR/../sglang/prepare.sh"

# shellcheck source=e2e/prepare_lib.sh
source "$SCRIPT_DIR/../prepare_lib.sh"
begin_home "$PD_HOME"

# Step 1: the transfer engine, beside (not in) the engines' environments.
mc_key="$(echo "$MOONCAKE" | sha256sum | cut -d' ' -f1)"
mc_marker="$PD_HOME/mooncake/.dprouter-installed"
if marked "$mc_marker" "$mc_key"; then
    log "mooncake: up to date, skipped"
else
    t0="$(now)"
    log "mooncake: installing $MOONCAKE"
    rm -rf "$PD_HOME/mooncake"
    "$VLLM_PYTHON" -m pip install --quiet --no-deps \
        --progress-bar off --target "$PD_HOME/mooncake" "$MOONCAKE"
    echo "$mc_key" >"$mc_marker"
    log "mooncake: done in $(took "$t0") s"
fi

# Step 2: the three libraries its shared objects link against.
MULTIARCH="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_config_var("MULTIARCH"))')"
have_libs() {
    local lib
    for lib in "${LIBS[@]}"; do dpkg -s "$lib" >/dev/null 2>&1 || return 1; done
}
debs_key="$(echo "${LIBS[*]} $MULTIARCH" | sha256sum | cut -d' ' -f1)"
debs_marker="$PD_HOME/debs/.dprouter-unpacked"
if have_libs; then
    log "libraries: ${LIBS[*]} installed on the system, nothing to unpack"
elif marked "$debs_marker" "$debs_key"; then
    log "libraries: up to date ($PD_HOME/debs), skipped"
else
    t0="$(now)"
    log "libraries: downloading ${LIBS[*]}"
    rm -rf "$PD_HOME/debs" "$PD_HOME/debs.tmp"
    mkdir -p "$PD_HOME/debs.tmp"
    (cd "$PD_HOME/debs.tmp" && apt-get download "${LIBS[@]}") || {
        echo "prepare.sh: apt-get download ${LIBS[*]} failed: install them" \
            "(apt-get install ${LIBS[*]}), or run apt-get update first" >&2
        exit 1
    }
    mkdir -p "$PD_HOME/debs"
    for deb in "$PD_HOME"/debs.tmp/*.deb; do dpkg-deb -x "$deb" "$PD_HOME/debs"; done
    rm -rf "$PD_HOME/debs.tmp"
    echo "$debs_key" >"$debs_marker"
    log "libraries: done in $(took "$t0") s"
fi

# Step 3: the transfer engine loads (its libraries found) in both engines' Pythons.
export LD_LIBRARY_PATH="$PD_HOME/debs/usr/lib/$MULTIARCH:$PD_HOME/debs/lib/$MULTIARCH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for python in "$VLLM_PYTHON" "$SGLANG_PYTHON"; do
    PYTHONPATH="$PD_HOME/mooncake" "$python" -c 'from mooncake.engine import TransferEngine; TransferEngine()' \
        || { echo "prepare.sh: Mooncake's transfer engine does not load in $python" >&2; exit 1; }
done
log "ready in $(took "$total_start") s: $PD_HOME ($(du -sh "$PD_HOME" | cut -f1))"
