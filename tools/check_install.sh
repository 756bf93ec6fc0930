#!/bin/sh
# check_install.sh BUILD_DIR - the README's link recipes, from an installed tree: a
# program linked with the shared library (found at run time through LD_LIBRARY_PATH,
# and through an rpath), one linked with libpagedkv.a as an archive (no libpagedkv.so
# needed at run time), and a fully static one (cc -static, where the host has the
# static C library). Run by .ci/run; exits non-zero on any failure. Each must get the
# pool the build promises (jemalloc when it has it). The man page must be installed
# where the build made one.
#
# `meson install --destdir D` puts the files under D, but pagedkv.pc still names the
# configured prefix: PKG_CONFIG_SYSROOT_DIR=D makes pkg-config prefix its -I and -L
# paths with D (the README says so too).
set -eu
build=${1:?usage: tools/check_install.sh BUILD_DIR}
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
meson install -C "$build" --destdir "$root" >/dev/null
pc=$(find "$root" -name pagedkv.pc | head -1)
[ -n "$pc" ] || { echo "check_install: no pagedkv.pc was installed" >&2; exit 1; }
export PKG_CONFIG_PATH="$(dirname "$pc")" PKG_CONFIG_SYSROOT_DIR="$root"
libdir=$(dirname "$(dirname "$pc")")

cat >"$root/app.c" <<'C'
#include <pagedkv.h>
#include <stdio.h>
int main(void)
{
    pkv_config c = pkv_config_default();
    c.n_layers = 1; c.n_heads = 4; c.n_kv_heads = 2; c.head_dim = 8;
    pkv_engine *e;
    if (pkv_engine_create(&c, &e) != PKV_OK)
        return 1;
    pkv_session *s;
    float kv[16] = {1}, q[32] = {1}, out[32];
    if (pkv_session_create(e, &s) != PKV_OK || pkv_append(s, 0, kv, kv) != PKV_OK ||
        pkv_decode(s, 0, q, out) != PKV_OK)
        return 1;
    pkv_stats st;
    if (pkv_engine_stats(e, &st) != PKV_OK)
        return 1;
    printf("pagedkv %s: out[0] = %g, pool %s\n", pkv_version(), (double)out[0], st.pool);
    pkv_session_destroy(s);
    pkv_engine_destroy(e);
    return out[0] == 1.0f ? 0 : 1;
}
C
cc=${CC:-cc}
# A build with jemalloc puts it on the recipes' link line (pagedkv.pc's Libs, with
# --no-as-needed): programs linked by them must get the jemalloc pool, not the aligned
# one that libpagedkv.so falls back to when it is dlopen'ed without jemalloc.
if pkg-config --libs pagedkv | grep -q -- '-ljemalloc'; then want_pool=jemalloc; else want_pool=aligned; fi
check_pool() { # $1: the program's output
    echo "$1"
    case $1 in
    *"pool $want_pool") ;;
    *) echo "check_install: expected the $want_pool pool" >&2; exit 1 ;;
    esac
}
# 1. shared: the plain recipe
# shellcheck disable=SC2046
$cc -o "$root/app_shared" "$root/app.c" $(pkg-config --cflags --libs pagedkv)
check_pool "$(LD_LIBRARY_PATH="$libdir" "$root/app_shared")"
readelf -d "$root/app_shared" | grep -q 'NEEDED.*libpagedkv' ||
    { echo "check_install: the shared recipe did not link libpagedkv.so" >&2; exit 1; }
#    without LD_LIBRARY_PATH: the rpath recipe (a private prefix)
# shellcheck disable=SC2046
$cc -o "$root/app_rpath" "$root/app.c" $(pkg-config --cflags --libs pagedkv) \
    -Wl,-rpath,"$(pkg-config --variable=libdir pagedkv)"
check_pool "$(env -u LD_LIBRARY_PATH "$root/app_rpath")"
# 2. the archive: -l:libpagedkv.a names the file, so the linker cannot pick the .so
#    that sits beside it (plain --static still would)
# shellcheck disable=SC2046
$cc -o "$root/app_static" "$root/app.c" $(pkg-config --cflags pagedkv) \
    $(pkg-config --static --libs pagedkv | sed 's/-lpagedkv\b/-l:libpagedkv.a/')
check_pool "$("$root/app_static")"
if readelf -d "$root/app_static" | grep -q 'NEEDED.*libpagedkv'; then
    echo "check_install: the archive recipe still needs libpagedkv.so" >&2
    exit 1
fi
#    fully static, where the host has the static C library (libc6-dev: libc.a)
if [ -f "$($cc -print-file-name=libc.a)" ] && [ "$($cc -print-file-name=libc.a)" != libc.a ]; then
    # shellcheck disable=SC2046
    $cc -static -o "$root/app_full_static" "$root/app.c" $(pkg-config --cflags pagedkv) \
        $(pkg-config --static --libs pagedkv | sed 's/-lpagedkv\b/-l:libpagedkv.a/') \
        2>"$root/static.log" ||
        { cat "$root/static.log" >&2; echo "check_install: cc -static failed" >&2; exit 1; }
    check_pool "$("$root/app_full_static")"
fi
# the man page, where the build made one (not in a cross build)
if [ -f "$build/tools/pagedkv.1" ] && [ -z "$(find "$root" -path '*/man1/pagedkv.1')" ]; then
    echo "check_install: pagedkv.1 was not installed" >&2
    exit 1
fi
# 3. the Python package, when meson installed it: it loads the installed libpagedkv.so
#    with dlopen (no jemalloc linked into python3) and runs a decode
pkg=$(find "$root" -path '*/pagedkv/_lib.py' | head -1)
if [ -n "$pkg" ]; then
    for py in python3 /usr/bin/python3; do
        if "$py" -c 'import numpy' 2>/dev/null; then
            env -u LD_PRELOAD PYTHONPATH="$(dirname "$(dirname "$pkg")")" \
                PAGEDKV_LIBRARY="$libdir/libpagedkv.so.3" "$py" -c '
import numpy as np, pagedkv
with pagedkv.Engine(n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8) as e, e.session() as s:
    s.append(0, np.ones((2, 8)), np.ones((2, 8)))
    assert s.decode(0, np.ones((4, 8)))[0, 0] == 1.0
    print("python: pagedkv", pagedkv.version(), "pool", e.stats()["pool"])'
            break
        fi
    done
fi
echo "check_install: every link recipe builds and runs from an installed tree"
