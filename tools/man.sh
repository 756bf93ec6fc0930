#!/bin/sh
# man.sh - write the man page pagedkv(1) on stdout from the built command's own help
# texts: `pagedkv --help` for the synopsis and every `pagedkv help CMD`, each shown
# verbatim. So the page says what --help says, by construction. meson runs it at build
# time (tools/meson.build) and installs the page; any host that runs the binary can too:
#
#   sh tools/man.sh build/tools/pagedkv > pagedkv.1 && man ./pagedkv.1
set -eu
tool=$1
version=$("$tool" version | sed 's/^pagedkv //')

# roff: a backslash is \e; a line starting with . or ' would be a request: \& first
roff() {
    sed -e 's/\\/\\e/g' -e "s/^\\([.']\\)/\\\\\\&\\1/"
}

cat <<HEAD
.TH PAGEDKV 1 "" "pagedkv $version" "User Commands"
.SH NAME
pagedkv \\- paged KV cache and decode attention: generate, stress, bench, mem, inspect, quality
.SH SYNOPSIS
.B pagedkv
.I COMMAND
.RI [ OPTIONS ]
.br
.B pagedkv help
.I COMMAND
.br
.B pagedkv version
.SH DESCRIPTION
.nf
HEAD
"$tool" --help | roff
echo ".fi"
# the commands: the words at the start of the help's "commands:" lines
for cmd in $("$tool" --help | sed -n '/^commands:/,/^$/p' | awk 'NR > 1 && NF { print $1 }' |
             grep -v -x -e help -e version); do
    echo ".SH pagedkv $cmd"
    echo ".nf"
    "$tool" help "$cmd" | roff
    echo ".fi"
done
# the sharded modes, where this build has MPI
for cmd in stress generate; do
    if "$tool" "$cmd" --mpi --help >/dev/null 2>&1; then
        echo ".SH pagedkv $cmd --mpi"
        echo ".nf"
        "$tool" "$cmd" --mpi --help | roff
        echo ".fi"
    fi
done
cat <<TAIL
.SH FILES AND DOCUMENTATION
docs/tools.md and docs/generate.md in the source tree describe each command and its
output; README.md says where to get the stories260K model.
.SH EXIT STATUS
0 success, 1 a runtime failure, 2 a usage error, 130 after Ctrl-C where a command
prints what it measured so far.
TAIL
