#!/bin/sh
# check_rules.sh - the rules of HACKING.md ("Rules the build checks") as greps.
#
# Run from the repository root: sh tools/check_rules.sh [--only GROUP[,GROUP...]]
# Prints every violation as FILE:LINE: [group] what, and exits 1 when there is one
# (0 when none, 2 on a usage error). The meson test `rules` (suite unit) runs it.
#
# Groups (each can run alone with --only):
#   layout   who may touch what: the block table's struct is defined only in
#            src/cache/btable.c and page refs are read and written only there; the
#            pool's struct only in src/store/pool.c; the engine's struct only in
#            src/engine/engine.c, and no other library file includes engine/engine.h
#            (modules get narrow contexts); nothing under tools/, examples/ or bench/
#            includes src/ (by an #include or by meson's include directories).
#   kernels  src/kernels: no header uses a name that a file including it defines; no
#            macro defines a function; every #include is at the top of its file.
#   size     every source file of src/, include/, tools/, examples/ and bench/ has at
#            most 800 lines (include/pagedkv.h, the one public header, 900; the Check
#            suites under tests/ are not counted).
#   dated    no date, no "session N" narrative and no timing (a number with ms, us,
#            ns or GB/s) in the comments of src/ and the build files; figures live in
#            docs/performance.md, which a comment cites by its decision-table row.
#
# A rule that the compiler can hold is held there: the block table, the pool and the
# engine are opaque structs defined in their .c files, so what this script checks for
# them is that the definition stays there.
set -u

ALL_GROUPS="layout kernels size dated"
MAX_LINES=800
HEADER_MAX_LINES=900

usage() {
    echo "usage: sh tools/check_rules.sh [--only GROUP[,GROUP...]] [--list]"
    echo "groups: $ALL_GROUPS"
}

groups=$ALL_GROUPS
while [ $# -gt 0 ]; do
    case $1 in
    --only)
        [ $# -ge 2 ] || { usage >&2; exit 2; }
        groups=$(printf '%s' "$2" | tr ',' ' ')
        shift 2
        ;;
    --only=*)
        groups=$(printf '%s' "${1#--only=}" | tr ',' ' ')
        shift
        ;;
    --list)
        echo "$ALL_GROUPS"
        exit 0
        ;;
    -h | --help)
        usage
        exit 0
        ;;
    *)
        usage >&2
        exit 2
        ;;
    esac
done
for g in $groups; do
    case " $ALL_GROUPS " in
    *" $g "*) ;;
    *)
        echo "check_rules.sh: unknown group '$g'" >&2
        usage >&2
        exit 2
        ;;
    esac
done
if [ ! -f meson.build ] || [ ! -d src ] || [ ! -f include/pagedkv.h ]; then
    echo "check_rules.sh: run it from the repository root" >&2
    exit 2
fi

LC_ALL=C
export LC_ALL
out=$(mktemp "${TMPDIR:-/tmp}/check_rules.XXXXXX") || exit 2
trap 'rm -f "$out"' EXIT INT TERM

# report FILE LINE GROUP MESSAGE
report() {
    printf '%s:%s: [%s] %s\n' "$1" "$2" "$3" "$4" >>"$out"
}

# C files of the given trees, one per line, sorted (none: nothing).
c_files() {
    for d in "$@"; do
        [ -d "$d" ] && find "$d" -type f \( -name '*.c' -o -name '*.h' -o -name '*.cc' \)
    done | sort
}

# grep -nE PATTERN over FILES (one process), reporting every hit outside ALLOWED.
# only_in GROUP ALLOWED PATTERN MESSAGE FILE...
only_in() {
    grp=$1 allowed=$2 pat=$3 msg=$4
    shift 4
    [ $# -gt 0 ] || return 0
    grep -nHE -e "$pat" "$@" | while IFS=: read -r f ln _; do
        [ "$f" = "$allowed" ] || report "$f" "$ln" "$grp" "$msg"
    done
}

# FILE:LINE:CODE for every line of the C files given, comments and string literals
# blanked (one process for all of them).
code_lines() {
    [ $# -gt 0 ] || return 0
    awk '
        FNR == 1 { inc = 0 }
        {
            line = $0; o = ""; i = 1; n = length(line)
            while (i <= n) {
                c = substr(line, i, 1); c2 = substr(line, i, 2)
                if (inc) {
                    if (c2 == "*/") { inc = 0; i += 2; o = o "  " } else { o = o " "; i++ }
                    continue
                }
                if (c2 == "/*") { inc = 1; o = o "  "; i += 2; continue }
                if (c2 == "//") break
                if (c == "\"" || c == "\047") {
                    q = c; o = o " "; i++
                    while (i <= n && substr(line, i, 1) != q) {
                        if (substr(line, i, 1) == "\\") { o = o " "; i++ }
                        o = o " "; i++
                    }
                    o = o " "; i++; continue
                }
                o = o c; i++
            }
            printf "%s:%d:%s\n", FILENAME, FNR, o
        }
    ' "$@"
}

# ---- layout ----------------------------------------------------------------------------

check_layout() {
    lib=$(c_files src)
    tst=$(c_files tests)
    # shellcheck disable=SC2086
    only_in layout src/cache/btable.c '^[[:space:]]*struct[[:space:]]+pkvi_btable[[:space:]]*\{' \
        "struct pkvi_btable is defined only in src/cache/btable.c" $lib $tst
    # A page descriptor is always reached through a pointer, so ->refs is its field
    # (pkv_page_info.refs, the public copy, is reached with a dot). Code only: a
    # comment may name the field.
    # shellcheck disable=SC2086
    code_lines $lib $tst | grep -E -e ':[0-9]+:.*->[[:space:]]*(refs|indexed)([^A-Za-z0-9_]|$)' |
        while IFS=: read -r f ln _; do
            [ "$f" = src/cache/btable.c ] ||
                report "$f" "$ln" layout "page refs are read and written only in src/cache/btable.c"
        done
    # shellcheck disable=SC2086
    only_in layout src/store/pool.c '^[[:space:]]*struct[[:space:]]+pkvi_pool[[:space:]]*\{' \
        "struct pkvi_pool is defined only in src/store/pool.c" $lib $tst
    # shellcheck disable=SC2086
    only_in layout src/engine/engine.c '^[[:space:]]*struct[[:space:]]+pkv_engine[[:space:]]*\{' \
        "struct pkv_engine is defined only in src/engine/engine.c" $lib $tst
    # modules get narrow contexts: the engine's own header is for engine.c (and the
    # tests' umbrella src/internal.h)
    # shellcheck disable=SC2086
    grep -nHE '^[[:space:]]*#[[:space:]]*include[[:space:]]+"engine/engine\.h"' $lib |
        while IFS=: read -r f ln _; do
            case $f in src/engine/engine.c | src/engine/engine.h | src/internal.h) continue ;; esac
            report "$f" "$ln" layout "only src/engine/engine.c includes engine/engine.h"
        done
    # the public header only, outside the library: a quoted include that is not the
    # includer's own (its folder, its tree's root, the example it builds) and names a
    # file of src/
    files=$(c_files tools examples bench)
    # shellcheck disable=SC2086
    [ -n "$files" ] && grep -nHE '^[[:space:]]*#[[:space:]]*include[[:space:]]+"[^"]+"' $files |
        while IFS=: read -r f ln text; do
            inc=${text#*\"}
            inc=${inc%%\"*}
            top=${f%%/*}
            case $inc in
            pagedkv.h) continue ;;
            src/* | */src/*)
                report "$f" "$ln" layout "includes $inc: outside the library, the public header only"
                continue
                ;;
            esac
            [ -e "${f%/*}/$inc" ] && continue
            [ -e "$top/$inc" ] && continue
            [ -e "examples/llama/$inc" ] && continue
            if [ -e "src/$inc" ] || [ "$inc" = internal.h ]; then
                report "$f" "$ln" layout "includes $inc from src/: outside the library, the public header only"
            fi
        done
    builds=$(find tools examples bench -name meson.build 2>/dev/null | sort)
    # shellcheck disable=SC2086
    [ -n "$builds" ] && grep -nHE "include_directories[[:space:]]*:[[:space:]]*\[?[[:space:]]*inc([^A-Za-z0-9_]|$)|'(\.\./)*src'" $builds |
        while IFS=: read -r f ln _; do
            report "$f" "$ln" layout "builds with src/ on the include path: outside the library, the public header only"
        done
    return 0
}

# ---- kernels -----------------------------------------------------------------------------

# Names FILE defines at file scope: macros, functions, typedefs and the names a
# closing brace ends (a struct's typedef). With "decl" as $2, also what it declares
# for others to define (prototypes that are not static, extern objects): what a
# header names of its own. A static prototype is a promise its includer keeps, so it
# is not the header's.
defined_names() {
    awk -v decl="${2:-}" '
        function settle(text,    k, c) {
            for (k = 1; k <= length(text); k++) {
                c = substr(text, k, 1)
                if (c == "(") depth++
                else if (c == ")") depth--
                else if (depth == 0 && c == "{") { print fname; fname = ""; return }
                else if (depth == 0 && c == ";") {
                    if (decl == "decl" && !fstatic) print fname
                    fname = ""; return
                }
            }
        }
        fname != "" { settle($0); next }
        /^[[:space:]]*#[[:space:]]*define[[:space:]]+[A-Za-z_]/ {
            s = $0; sub(/^[[:space:]]*#[[:space:]]*define[[:space:]]+/, "", s)
            match(s, /^[A-Za-z_][A-Za-z0-9_]*/); print substr(s, 1, RLENGTH); next
        }
        /^[A-Za-z_][A-Za-z0-9_ \t*]*[ \t*][A-Za-z_][A-Za-z0-9_]*[ \t]*\(/ && !/^typedef/ {
            s = $0; sub(/[ \t]*\(.*/, "", s); n = split(s, w, /[ \t*]+/)
            fname = w[n]; fstatic = $0 ~ /^(static|AI)[ \t]/ || $0 ~ /[ \t]static[ \t]/
            depth = 0; rest = $0; sub(/^[^(]*/, "", rest); settle(rest); next
        }
        decl == "decl" && /^[ \t]*extern[ \t]/ {
            s = $0; sub(/[ \t]*(\[.*)?;.*/, "", s); n = split(s, w, /[ \t*]+/); print w[n]; next
        }
        /^}[ \t]*[A-Za-z_][A-Za-z0-9_]*[ \t]*;/ {
            s = $0; sub(/^}[ \t]*/, "", s); sub(/[ \t]*;.*/, "", s); print s; next
        }
        /^typedef[^;(]*[ \t*][A-Za-z_][A-Za-z0-9_]*[ \t]*;/ {
            s = $0; sub(/[ \t]*;.*/, "", s); n = split(s, w, /[ \t*]+/); print w[n]; next
        }
    ' "$1" | sort -u
}

# The lines of FILE with comments and string literals blanked (line numbers kept).
code_only() {
    awk '
        BEGIN { inc = 0 }
        {
            line = $0; o = ""; i = 1; n = length(line)
            while (i <= n) {
                c = substr(line, i, 1); c2 = substr(line, i, 2)
                if (inc) {
                    if (c2 == "*/") { inc = 0; i += 2; o = o "  " } else { o = o " "; i++ }
                    continue
                }
                if (c2 == "/*") { inc = 1; o = o "  "; i += 2; continue }
                if (c2 == "//") break
                if (c == "\"" || c == "\047") {
                    q = c; o = o " "; i++
                    while (i <= n && substr(line, i, 1) != q) {
                        if (substr(line, i, 1) == "\\") { o = o " "; i++ }
                        o = o " "; i++
                    }
                    o = o " "; i++; continue
                }
                o = o c; i++
            }
            print o
        }
    ' "$1"
}

check_kernels() {
    [ -d src/kernels ] || return 0
    kfiles=$(c_files src/kernels)
    # 1. no header uses a name its includer defines. Two checks that together say it:
    #    (a) no file defines a macro and then includes a kernels header (a template
    #        parameter: the pattern this rule forbids; include guards excepted), and
    #    (b) each kernels header compiles alone, with every ISA flag and nothing
    #        before it (needs the compiler; skipped without one, said so).
    for f in $kfiles; do
        code_only "$f" | awk -v F="$f" '
            /^[ \t]*#[ \t]*ifndef[ \t]/ { guard = NR; next }
            /^[ \t]*#[ \t]*define[ \t]+[A-Za-z_]/ {
                if (guard == NR - 1) next
                if (!first) { first = NR; s = $0; sub(/^[ \t]*#[ \t]*define[ \t]+/, "", s)
                              match(s, /^[A-Za-z_][A-Za-z0-9_]*/); name = substr(s, 1, RLENGTH) }
                next
            }
            /^[ \t]*#[ \t]*include[ \t]*"/ {
                if (first) printf "%s:%d: [kernels] includes a header after defining %s (line %d): a header takes nothing from its includer\n", F, NR, name, first
            }
        ' >>"$out"
    done
    cc=${CC:-cc}
    if command -v "$cc" >/dev/null 2>&1 && [ -f include/pagedkv.h ]; then
        cfg=$(mktemp -d "${TMPDIR:-/tmp}/check_rules.XXXXXX") || exit 2
        # pkv_config.h is generated by meson; an empty stand-in is enough to compile alone
        printf '#define PKV_HAVE_JEMALLOC 0\n#define PKV_HAVE_URING 0\n#define PKV_POISON 0\n#define PKV_HAVE_X86_KERNELS 1\n#define PKV_AVX512_EMULATED 0\n#define PKV_VERSION_STRING "0"\n' \
            >"$cfg/pkv_config.h"
        isa=""
        # the aarch64 headers (arm_neon.h) with an aarch64 compiler: the host's, or
        # Debian's cross compiler where there is one (else they are not compiled alone)
        armcc="" armisa="-march=armv8.2-a+dotprod"
        case $(uname -m) in
        x86_64) isa="-mavx2 -mfma -mf16c -mavxvnni -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni"
            command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 && armcc=aarch64-linux-gnu-gcc ;;
        aarch64) armcc=$cc ;;
        esac
        for h in $kfiles; do
            case $h in *.h) ;; *) continue ;; esac
            hcc=$cc hisa=$isa
            if grep -q arm_neon "$h"; then
                [ -n "$armcc" ] || continue
                hcc=$armcc hisa=$armisa
            else
                case $(uname -m) in x86_64) ;; *) grep -q immintrin "$h" && continue ;; esac
            fi
            # shellcheck disable=SC2086
            if ! printf '#include "%s"\n' "${h#src/}" |
                "$hcc" -std=c11 -fsyntax-only -D_GNU_SOURCE $hisa -Isrc -Iinclude -I"$cfg" -x c - \
                    >"$cfg/log" 2>&1; then
                printf "%s:1: [kernels] does not compile alone: %s\n" "$h" \
                    "$(grep -m1 error "$cfg/log" | sed 's/^<stdin>[^ ]* //')" >>"$out"
            fi
        done
        rm -rf "$cfg"
    else
        echo "check_rules.sh: no C compiler ($cc): kernels headers not compiled alone" >&2
    fi
    # 2. no macro defines a function: a #define whose text has a parameter list
    #    followed by a body
    for f in $kfiles; do
        awk -v F="$f" '
            function flush() {
                if (body != "" && body ~ /[A-Za-z0-9_#][ \t]*\([^;{}()]*(\([^;{}()]*\)[^;{}()]*)*\)[ \t]*\{/ &&
                    body ~ /(^|[^A-Za-z0-9_])(static|inline|void|int|float|double|bool|size_t|uint[0-9]+_t|int[0-9]+_t|AI|__m[0-9]+[a-z]*)[ \t*]+[A-Za-z_][A-Za-z0-9_#]*[ \t]*\(/)
                    printf "%s:%d: [kernels] macro %s defines a function\n", F, start, name
                body = ""
            }
            {
                l = $0; sub(/\\[ \t]*$/, "", l)
                if (cont) { body = body " " l }
                else if (l ~ /^[ \t]*#[ \t]*define[ \t]+[A-Za-z_]/) {
                    start = NR; s = l; sub(/^[ \t]*#[ \t]*define[ \t]+/, "", s)
                    match(s, /^[A-Za-z_][A-Za-z0-9_]*(\([^)]*\))?/)
                    name = substr(s, 1, RLENGTH); body = substr(s, RLENGTH + 1)
                    if (body == "") body = " "
                }
                cont = ($0 ~ /\\[ \t]*$/)
                if (!cont && body != "") flush()
            }
        ' "$f" >>"$out"
    done
    # 3. every #include is at the top: none after the first line of code
    for f in $kfiles; do
        code_only "$f" | awk -v F="$f" '
            /^[ \t]*$/ { next }
            /^[ \t]*#[ \t]*include/ {
                if (seen) printf "%s:%d: [kernels] #include below code (line %d): includes go at the top\n", F, NR, seen
                next
            }
            /^[ \t]*#[ \t]*(if|ifdef|ifndef|elif|else|endif|pragma|error|warning|undef)/ { if ($0 ~ /ifndef/) guard = NR; next }
            /^[ \t]*#[ \t]*define[ \t]+[A-Za-z_][A-Za-z0-9_]*[ \t]*$/ { if (guard == NR - 1) next }
            { if (!seen) seen = NR }
        ' >>"$out"
    done
}

# ---- size ----------------------------------------------------------------------------------

check_size() {
    for d in src include tools examples bench; do
        [ -d "$d" ] || continue
        find "$d" -type f \( -name '*.c' -o -name '*.h' -o -name '*.cc' -o -name '*.py' \
            -o -name '*.sh' -o -name 'meson.build' \) | sort
    done | while read -r f; do
        n=$(wc -l <"$f")
        max=$MAX_LINES
        # the public header is the product's one file and its documentation: one
        # concern at any length, split only where a user would include two files
        [ "$f" = include/pagedkv.h ] && max=$HEADER_MAX_LINES
        [ "$n" -le "$max" ] && continue
        report "$f" "$n" size "$n lines: a file stays under ~$max, with one concern"
    done
}

# ---- dated -----------------------------------------------------------------------------------

# dated_scan KIND FILE...: the comments of C files (KIND c: /* */ and //, strings
# skipped) or meson files (KIND meson: from a # outside a string), each checked for a
# "session N" narrative and a timing; every line of the files for a date.
dated_scan() {
    kind=$1
    shift
    [ $# -gt 0 ] || return 0
    awk -v kind="$kind" '
        FNR == 1 { inc = 0 }
        function report(msg) { printf "%s:%d: [dated] %s\n", FILENAME, FNR, msg }
        function comment_of(line,    o, i, n, c, c2, q) {
            o = ""; n = length(line)
            if (kind == "meson") {
                q = 0
                for (i = 1; i <= n; i++) {
                    c = substr(line, i, 1)
                    if (c == "\047") q = !q
                    else if (c == "#" && !q) return substr(line, i + 1)
                }
                return ""
            }
            i = 1
            while (i <= n) {
                c = substr(line, i, 1); c2 = substr(line, i, 2)
                if (inc) {
                    if (c2 == "*/") { inc = 0; i += 2; o = o " "; continue }
                    o = o c; i++; continue
                }
                if (c2 == "/*") { inc = 1; i += 2; continue }
                if (c2 == "//") { o = o substr(line, i + 2); break }
                if (c == "\"" || c == "\047") {
                    q = c; i++
                    while (i <= n && substr(line, i, 1) != q) {
                        if (substr(line, i, 1) == "\\") i++
                        i++
                    }
                    i++; continue
                }
                i++
            }
            return o
        }
        {
            if ($0 ~ /(^|[^0-9])20[0-9][0-9]-[01][0-9]-[0-3][0-9]([^0-9]|$)/)
                report("a date: history lives in git and CHANGELOG.md")
            t = comment_of($0)
            if (t == "")
                next
            if (tolower(t) ~ /(^|[^a-z])session[ \t]+[0-9]+([^0-9]|$)/)
                report("\"session N\" narrative in a comment")
            if (t ~ /[0-9][0-9.,]*[ \t-]*(ms|us|ns|µs|[GMK]i?B\/s)([^A-Za-z0-9]|$)/)
                report("a timing in a comment: cite docs/performance.md\047s decision table instead")
        }
    ' "$@" >>"$out"
}

check_dated() {
    # shellcheck disable=SC2046
    dated_scan c $(c_files src)
    # shellcheck disable=SC2046
    dated_scan meson $(find . -path ./build -prune -o -path './build-*' -prune \
        -o -path ./.git -prune -o \( -name meson.build -o -name meson_options.txt \) \
        -type f -print | sed 's|^\./||' | sort)
}


for g in $groups; do
    "check_$g"
done
if [ -s "$out" ]; then
    sort -t: -k1,1 -k2,2n "$out" | uniq
    n=$(sort -u "$out" | wc -l)
    echo "check_rules.sh: $n violation(s) in: $groups" >&2
    exit 1
fi
echo "check_rules.sh: every rule holds ($groups)"
exit 0
