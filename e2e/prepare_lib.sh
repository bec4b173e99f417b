# What the real-engine prepare scripts share; sourced by e2e/prepare.sh (vLLM) and
# e2e/sglang/prepare.sh (SGLang), each of which sets PREPARE_NAME first.
#
#   begin_home DIR        the environment's home, caches kept under DIR/cache, a TMPDIR
#                         removed on exit; exits unless $PYTHON (python3) is 3.11
#   locked_venv VENV LOCK CHECK
#                         step 1: a virtual environment from the exact lock (pip
#                         --no-deps: nothing else comes in), then the function CHECK
#                         (the engine's own sanity check, given the venv's python);
#                         skipped when VENV/.dprouter-installed holds the lock's hash
#   site_fixed VENV ENGINE [CHECK]
#                         step 2: e2e/site_fixes.py ENGINE in VENV, then CHECK (given the
#                         venv's python); skipped when VENV/.dprouter-patched holds the hash
#                         of the script and the install
#   marked MARKER KEY     true when the step that leaves MARKER is up to date with KEY
# Each step leaves a marker holding a hash of its inputs and is skipped when it matches.

PYTHON="${PYTHON:-python3}"

log() { printf '[%s prepare %(%H:%M:%S)T] %s\n' "$PREPARE_NAME" -1 "$*"; }
now() { date +%s.%N; }
took() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
hash_of() { cat "$@" | sha256sum | cut -d' ' -f1; }
marked() { [[ -f "$1" && "$(cat "$1")" == "$2" ]]; }

begin_home() {
    local home="$1"
    "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' \
        || { echo "prepare: need Python 3.11 as \$PYTHON (default python3)" >&2; exit 1; }
    CACHE="$home/cache"
    mkdir -p "$home" "$CACHE" "$home/logs"
    # Keep every cache out of the user's real ones.
    export HF_HOME="$CACHE/hf"
    export XDG_CACHE_HOME="$CACHE/xdg"
    export TORCHINDUCTOR_CACHE_DIR="$CACHE/inductor"
    export PIP_CACHE_DIR="$CACHE/pip"
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 DO_NOT_TRACK=1
    export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
    unset PYTHONPATH
    TMP_WORK="$(mktemp -d "$CACHE/tmp.XXXXXX")"
    export TMPDIR="$TMP_WORK"
    trap 'rm -rf "$TMP_WORK"' EXIT
    total_start="$(now)"
}

locked_venv() {
    local venv="$1" lock="$2" check="$3" t0
    venv_key="$(hash_of "$lock")"
    venv_marker="$venv/.dprouter-installed"
    if marked "$venv_marker" "$venv_key"; then
        log "venv: up to date ($venv), skipped"
        return
    fi
    t0="$(now)"
    log "venv: creating $venv"
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    log "venv: installing $(grep -c '^[^#]' "$lock") locked packages (pip --no-deps)"
    # (The filter drops pip's per-package notes about missing local index folders.)
    "$venv/bin/python" -m pip install --quiet --no-deps --progress-bar off -r "$lock" 2>&1 \
        | { grep -v "is ignored: it is neither a file nor a directory" || true; }
    "$venv/bin/python" -c 'import torch; assert torch.__version__.endswith("+cpu"), torch.__version__'
    "$check" "$venv/bin/python"
    echo "$venv_key" >"$venv_marker"
    log "venv: done in $(took "$t0") s ($(du -sh "$venv" | cut -f1))"
}

site_fixed() {
    local venv="$1" engine="$2" check="${3:-}" fixes key marker t0
    fixes="$(dirname "${BASH_SOURCE[0]}")/site_fixes.py"
    key="$(hash_of "$fixes" "$venv/.dprouter-installed")"
    marker="$venv/.dprouter-patched"
    if marked "$marker" "$key"; then
        log "fixes: up to date, skipped"
        return
    fi
    t0="$(now)"
    rm -f "$marker"
    log "fixes: applying $fixes"
    "$venv/bin/python" "$fixes" "$engine"
    if [[ -n "$check" ]]; then "$check" "$venv/bin/python"; fi
    echo "$key" >"$marker"
    log "fixes: done in $(took "$t0") s"
}
