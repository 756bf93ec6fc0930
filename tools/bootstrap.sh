#!/bin/sh
# bootstrap.sh - set up a fresh Debian machine for pagedkv, build it, and run the
# main job or the tests. Idempotent: packages already present are not reinstalled,
# an existing build directory is reused.
#
#   tools/bootstrap.sh run     install what is missing, build, run `pagedkv generate`:
#                              a story of stories260K where the model is found
#                              ($PKV_MODEL_DIR, models/, ../shared/models), else the
#                              built-in synthetic model, with how to get the real one
#   tools/bootstrap.sh test    install what is missing, build, run the whole test suite
#   tools/bootstrap.sh build   install what is missing and build
#
# Environment: BUILD_DIR (default: build), MESON_ARGS (extra `meson setup` arguments),
# PKV_MODEL_DIR (where stories260K.bin and tok512.bin are; README.md, "A real model").
set -eu

usage() {
    echo "usage: tools/bootstrap.sh [run|test|build]"
    echo "  run    install what is missing, build, run \`pagedkv generate\` (default)"
    echo "  test   install what is missing, build, run the whole test suite"
    echo "  build  install what is missing and build"
}

MODE=${1:-run}
# The mode is checked before any work: a typo must not cost an apt-get and a build.
case "$MODE" in
run | test | build) ;;
-h | --help)
    usage
    exit 0
    ;;
*)
    echo "bootstrap: unknown mode '$MODE'" >&2
    usage >&2
    exit 2
    ;;
esac
if [ $# -gt 1 ]; then
    echo "bootstrap: one mode only ('$2' is extra)" >&2
    usage >&2
    exit 2
fi

cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}

# Debian packages the build and the tests need (pkg-config names checked below);
# python3 and python3-numpy for the Python package and its tests (tests/python), and
# python3-venv for its pip install into a virtual environment (test_install), Open
# MPI for the tools' --mpi modes and their tests (tests/test_mpi.c).
PKGS="meson ninja-build pkg-config gcc libc6-dev libjemalloc-dev liburing-dev check python3
      python3-numpy python3-venv libopenmpi-dev openmpi-bin"

missing=""
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
        missing="$missing $p"
done
if [ -n "$missing" ]; then
    echo "bootstrap: installing:$missing" >&2
    if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    # shellcheck disable=SC2086 # one word per package
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing
fi

if [ ! -f "$BUILD_DIR/build.ninja" ]; then
    # shellcheck disable=SC2086
    meson setup "$BUILD_DIR" ${MESON_ARGS:-}
fi
ninja -C "$BUILD_DIR"

case "$MODE" in
run)
    # the real model where its two files are, as the tests look for them
    model_dir=""
    for d in "${PKV_MODEL_DIR:-}" models ../shared/models; do
        if [ -n "$d" ] && [ -r "$d/stories260K.bin" ] && [ -r "$d/tok512.bin" ]; then
            model_dir=$d
            break
        fi
    done
    if [ -n "$model_dir" ]; then
        echo "bootstrap: stories260K from $model_dir/, a story after \"Once upon a time\":" >&2
        "$BUILD_DIR/tools/pagedkv" generate --model "$model_dir/stories260K.bin" \
            --tokenizer "$model_dir/tok512.bin" -i "Once upon a time"
    else
        echo "bootstrap: no stories260K.bin and tok512.bin in \$PKV_MODEL_DIR, models/ or" \
            "../shared/models: running the built-in synthetic model (random weights)" >&2
        "$BUILD_DIR/tools/pagedkv" generate
        cat >&2 <<'EOF'
bootstrap: that was `pagedkv generate` on synthetic weights: the numbers are token ids
of a model that knows no language, generated through the paged cache (the figures above
are real). For text, fetch stories260K and its tokenizer into models/ (README.md, "A
real model": two curl commands and their sha256) and run `sh tools/bootstrap.sh run`
again.
EOF
    fi
    ;;
test)
    meson test -C "$BUILD_DIR" --print-errorlogs --num-processes 2
    ;;
build) ;;
esac
