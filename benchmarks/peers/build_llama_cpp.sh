#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-bench, llama-quantize and
# llama-perplexity (the W2-W5 peer and the accuracy anchor), from the
# source vendored in the llama-cpp-python sdist (PyPI works here; GitHub does
# not). Idempotent: a finished build is reused. Takes about 5 min on 2 cores.
#
#   benchmarks/peers/build_llama_cpp.sh
#
# Writes under ${TOKENMILL_PEERS_DIR:-$HOME/.cache/tokenmill-peers}/llama.cpp
# and prints the binaries' paths as KEY=PATH lines on stdout (the last
# lines); everything else goes to stderr.
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PEERS_DIR="${TOKENMILL_PEERS_DIR:-$HOME/.cache/tokenmill-peers}"
ROOT="$PEERS_DIR/llama.cpp"
SRC="$ROOT/src-$LLAMA_CPP_PYTHON_VERSION"
BUILD="$ROOT/build-$LLAMA_CPP_PYTHON_VERSION"
BIN="$BUILD/bin"
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc)}"

fail() { echo "build_llama_cpp.sh: $*" >&2; exit 1; }
log() { echo "build_llama_cpp.sh: $*" >&2; }

report() {
    echo "LLAMA_SERVER=$BIN/llama-server"
    echo "LLAMA_BENCH=$BIN/llama-bench"
    echo "LLAMA_QUANTIZE=$BIN/llama-quantize"
    echo "LLAMA_PERPLEXITY=$BIN/llama-perplexity"
}

if [[ -x "$BIN/llama-server" && -x "$BIN/llama-bench" && -x "$BIN/llama-quantize" \
      && -x "$BIN/llama-perplexity" && -f "$BUILD/.done" ]]; then
    log "already built in $BUILD"
    report
    exit 0
fi

mkdir -p "$PEERS_DIR"
# One build at a time: two benchmarks started together must not share a build dir.
exec 9>"$ROOT.lock"
flock 9
if [[ -x "$BIN/llama-server" && -x "$BIN/llama-bench" && -x "$BIN/llama-quantize" \
      && -x "$BIN/llama-perplexity" && -f "$BUILD/.done" ]]; then
    log "built meanwhile by another run in $BUILD"
    report
    exit 0
fi
command -v cmake >/dev/null || fail "cmake not found (apt-get install cmake)"
command -v c++ >/dev/null || fail "no C++ compiler found (apt-get install g++)"
mkdir -p "$ROOT"

if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    log "fetching the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist from PyPI"
    DL="$ROOT/sdist"
    rm -rf "$DL" && mkdir -p "$DL"
    # --no-binary for this one package only: with `:all:` pip also builds
    # the sdist's build backend and its dependencies from source.
    "$PYTHON" -m pip download --quiet --no-binary llama-cpp-python --no-deps \
        --dest "$DL" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" >&2 \
        || fail "pip download llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION failed"
    TARBALL="$(ls "$DL"/*.tar.gz 2>/dev/null | head -1)"
    [[ -n "$TARBALL" ]] || fail "no sdist tarball in $DL"
    tar -xzf "$TARBALL" -C "$DL"
    VENDOR="$(ls -d "$DL"/*/vendor/llama.cpp 2>/dev/null | head -1)"
    [[ -n "$VENDOR" && -f "$VENDOR/CMakeLists.txt" ]] \
        || fail "no vendor/llama.cpp in $TARBALL"
    rm -rf "$SRC"
    mv "$VENDOR" "$SRC"
    rm -rf "$DL"
fi

log "configuring in $BUILD (Release, GGML_NATIVE=ON, no curl, no openssl)"
GENERATOR=()
command -v ninja >/dev/null && GENERATOR=(-G Ninja)
cmake -S "$SRC" -B "$BUILD" "${GENERATOR[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF >&2 \
    || fail "cmake configure failed (see above)"
log "building llama-server llama-bench llama-quantize llama-perplexity with $JOBS jobs (about 5 min on 2 cores)"
cmake --build "$BUILD" --config Release -j "$JOBS" --target llama-server llama-bench llama-quantize llama-perplexity >&2 \
    || fail "cmake build failed (see above)"
for tool in llama-server llama-bench llama-quantize llama-perplexity; do
    [[ -x "$BIN/$tool" ]] || fail "build finished but $BIN/$tool is missing"
done
"$BIN/llama-bench" --help >/dev/null 2>&1 || fail "$BIN/llama-bench does not run"
touch "$BUILD/.done"
report
