#!/bin/sh
# check.sh MODE - the instrumented and cross test runs, exactly as CI runs them: .ci/run
# calls this script, and README.md and HACKING.md give these commands, so there is one
# recipe of each. Every command is printed (with a "+") before it runs.
#
#   tools/check.sh asan       ASan + UBSan build (build-asan): every suite at quick counts
#                             (PKV_TEST_QUICK=1) with 4x timeouts, the pipeline suites on
#                             the one SIMD table only (not the tests that run no library
#                             code: rules, header-*, python-install), then the kernel
#                             suites at full counts
#   tools/check.sh tsan       ThreadSanitizer build (build-tsan): the suites that drive
#                             the engine's worker threads, and the spill transfers that
#                             run beside other calls (transit), at quick counts, the
#                             pipeline suites on the one SIMD table
#   tools/check.sh valgrind   memcheck (build-vg): the suites that write to disk (io:
#                             io, persist, spill, robust), at quick counts (meson's
#                             valgrind setup)
#   tools/check.sh aarch64    the cross build of cross/aarch64-linux-gnu.ini as it
#                             documents it (release) under qemu-user, at quick counts:
#                             the kernel and quant suites on neon and neon_dotprod, the
#                             unit suite's pipeline runs on the best table (qemu's CPU
#                             has asimddp: neon_dotprod), and dispatch on a CPU without
#                             asimddp (QEMU_CPU=cortex-a53). The scalar runs are left to
#                             x86-64's CI: the same C code, natively.
#
# The instrumented trees build one SIMD table beside scalar (-Dkernels=avx2 on x86-64;
# every kernel table runs uninstrumented in the README test command): the sanitizers
# watch the engine, and memcheck cannot run AVX-512. Their pipeline suites run on that
# table only (one_isa below): the scalar table's runs of them exercise the same engine
# code, and the kernel and quant suites hold the scalar kernel to its contract.
#
# A build directory that exists is reused (its options are not changed). What a mode
# needs and the machine lacks (valgrind; the aarch64 cross toolchain and arm64
# libraries) is installed with apt-get, as root or through sudo.
set -eu

MODE=${1:-}
case "$MODE" in
asan | tsan | valgrind | aarch64) ;;
-h | --help)
    # the header of this file, without its comment marks
    sed -n '2,/^set -eu/p' "$0" | sed -e '/^set -eu/d' -e 's/^# \{0,1\}//'
    exit 0
    ;;
*)
    echo "check: unknown mode '$MODE'" >&2
    echo "usage: tools/check.sh asan|tsan|valgrind|aarch64" >&2
    exit 2
    ;;
esac
cd "$(dirname "$0")/.."

run() {
    echo "+ $*" >&2
    "$@"
}
if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
# one_isa DIR SUITE...: the tests of those suites (all with no suite) in build DIR but
# the pipeline suites' scalar runs (tests named *-scalar outside kernels and quant)
one_isa() {
    dir=$1
    shift
    sel=""
    for su in "$@"; do sel="$sel --suite $su"; done
    # shellcheck disable=SC2086 # one word per option
    meson test -C "$dir" --list $sel 2>/dev/null | sed -n 's|^pagedkv:[^ ]* / ||p' |
        grep -v -E -e '-scalar$' || true
    # shellcheck disable=SC2086
    meson test -C "$dir" --list $sel 2>/dev/null | sed -n 's|^pagedkv:[^ ]* / ||p' |
        grep -E -e '^(kernels|quant)-scalar$' || true
}
case "$(uname -m)" in
x86_64) ONE_TABLE=-Dkernels=avx2 ;;
*) ONE_TABLE=-Dkernels=auto ;;
esac
apt_install() {
    # shellcheck disable=SC2086 # one word per package
    run env DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$@"
}

case "$MODE" in
asan)
    # the pool on aligned_alloc (-Djemalloc=disabled): the sanitizer sees every page.
    # Optimized with debug info (-O2 -g), as ASan's own documentation advises for
    # speed: the instrumentation and checks are the same as at -O0, and the compute
    # suites run several times faster (docs/performance.md, "CI step times").
    if [ ! -f build-asan/build.ninja ]; then
        run meson setup build-asan -Dbuildtype=debugoptimized -Db_sanitize=address,undefined \
            -Db_lundef=false -Djemalloc=disabled -Dpoison=true "$ONE_TABLE"
    fi
    run ninja -C build-asan
    # all but the tests that run no library code of this tree: the rules (a script),
    # the header compiled alone, the Python package's install (packaging)
    tests=$(one_isa build-asan |
        grep -v -E -x -e 'rules|header-c|header-cxx|header-macros|python-install' || true)
    # shellcheck disable=SC2086 # one word per test
    run env PKV_TEST_QUICK=1 CK_TIMEOUT_MULTIPLIER=4 ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
        UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
        meson test -C build-asan --print-errorlogs --num-processes 2 --timeout-multiplier 4 \
        $tests
    # the kernels once more at full counts: every shape of the shape table, where an
    # overread of a tail would be
    run env CK_TIMEOUT_MULTIPLIER=4 ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
        UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
        meson test -C build-asan --print-errorlogs --num-processes 2 --timeout-multiplier 4 \
        --suite kernels
    ;;
tsan)
    if [ ! -f build-tsan/build.ninja ]; then
        run meson setup build-tsan -Dbuildtype=debugoptimized -Db_sanitize=thread \
            -Db_lundef=false -Djemalloc=disabled "$ONE_TABLE"
    fi
    run ninja -C build-tsan
    tests=$(one_isa build-tsan session kernels sharing variants prefix shard transit persist io)
    # shellcheck disable=SC2086 # one word per test
    run env PKV_TEST_QUICK=1 CK_TIMEOUT_MULTIPLIER=4 TSAN_OPTIONS=halt_on_error=1:allocator_may_return_null=1 \
        meson test -C build-tsan --print-errorlogs --num-processes 2 $tests
    ;;
valgrind)
    command -v valgrind >/dev/null 2>&1 || apt_install valgrind
    if [ ! -f build-vg/build.ninja ]; then
        run meson setup build-vg -Dbuildtype=debugoptimized -Djemalloc=disabled "$ONE_TABLE"
    fi
    run ninja -C build-vg
    # The suites that write to disk (the io suite): what ASan cannot see there is a
    # read of uninitialized bytes that reaches a file. Compute suites run under
    # ASan+UBSan, whose coverage memcheck would repeat (docs/performance.md, "CI step
    # times"). meson's valgrind setup (tests/meson.build) sets PKV_TEST_QUICK=1 and 20x
    # timeouts.
    run meson test -C build-vg --setup=valgrind --print-errorlogs --num-processes 2 \
        --suite io
    ;;
aarch64)
    # Debian multiarch: the arm64 libraries install beside the native ones, except
    # libjemalloc-dev (its /usr/bin/jeprof clashes with the amd64 package's), which is
    # unpacked into build-aarch64-deps/ instead of replacing the native one.
    if ! dpkg --print-foreign-architectures | grep -qx arm64; then
        run $SUDO dpkg --add-architecture arm64
        run $SUDO apt-get update -qq
    fi
    xmissing=""
    for p in gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user libjemalloc2:arm64 \
             liburing-dev:arm64 check:arm64; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
            xmissing="$xmissing $p"
    done
    # shellcheck disable=SC2086
    [ -z "$xmissing" ] || apt_install $xmissing
    xdeps=$(pwd)/build-aarch64-deps
    xpc=$xdeps/root/usr/lib/aarch64-linux-gnu/pkgconfig
    if [ ! -f "$xpc/jemalloc.pc" ]; then
        rm -rf "$xdeps" && mkdir -p "$xdeps"
        (cd "$xdeps" && run apt-get download libjemalloc-dev:arm64 &&
            run dpkg-deb -x libjemalloc-dev_*_arm64.deb root)
        sed -i "s|^prefix=.*|prefix=$xdeps/root/usr|" "$xpc/jemalloc.pc"
        ln -sf /usr/lib/aarch64-linux-gnu/libjemalloc.so.2 \
            "$xdeps/root/usr/lib/aarch64-linux-gnu/libjemalloc.so"
    fi
    # the cross file's own setup line (its default, release, buildtype) and the arm64
    # jemalloc's .pc
    if [ ! -f build-aarch64/build.ninja ]; then
        run meson setup build-aarch64 --cross-file cross/aarch64-linux-gnu.ini \
            -Dpkg_config_path="$xpc"
    fi
    run ninja -C build-aarch64
    # the kernel and unit suites but their scalar runs (the C code x86-64's CI runs) and
    # `rules` (a script over the source tree, the same on every host)
    xtests=$(meson test -C build-aarch64 --list --suite unit --suite kernels 2>/dev/null |
        grep -v ' / .*-scalar$' | sed -n 's|^pagedkv:[^ ]* / ||p' | grep -v -x 'rules')
    # shellcheck disable=SC2086
    run env PKV_TEST_QUICK=1 meson test -C build-aarch64 --print-errorlogs --num-processes 2 \
        --timeout-multiplier 4 $xtests
    # qemu's default CPU (max) has asimddp; a Cortex-A53 has not: neon_dotprod SKIPs and
    # the dispatcher picks neon
    run env QEMU_CPU=cortex-a53 meson test -C build-aarch64 --print-errorlogs \
        kernels-dispatch kernels-neon_dotprod
    ;;
esac
