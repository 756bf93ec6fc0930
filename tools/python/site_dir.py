"""site_dir.py PREFIX - where `meson install` puts the package for this interpreter.

Run by tools/python/meson.build with the interpreter it chose (the one with numpy).
Prints two lines: the directory, then "searched" if this interpreter imports from it
as it is, or "not-searched" (a prefix it does not look in: PYTHONPATH is needed).

The directory is the interpreter's own site directory (on its sys.path) that lies
under PREFIX, the one nearest PREFIX when there are several: Debian's python3
searches /usr/local/lib/python3.X/dist-packages (prefix /usr/local, meson's default)
and /usr/lib/python3/dist-packages (prefix /usr). meson's own choice for Debian's
python3, PREFIX/lib/python3/dist-packages, is searched only for PREFIX /usr. A
virtual environment's python3 searches VENV/lib/python3.X/site-packages (prefix
VENV). For any other prefix the directory is PREFIX/lib/python3.X/site-packages
(sysconfig's posix_prefix scheme), and it is not searched.
"""
import os
import sys
import sysconfig


def site_dir(prefix):
    prefix = os.path.normpath(os.path.abspath(prefix))
    candidates = []
    for p in sys.path + [sysconfig.get_path("purelib")]:
        p = os.path.normpath(p) if p else p
        if (p and os.path.basename(p) in ("site-packages", "dist-packages") and
                os.path.commonpath([p, prefix]) == prefix and p not in candidates):
            candidates.append(p)
    searched = [p for p in candidates if p in map(os.path.normpath, filter(None, sys.path))]
    if searched:
        return min(searched, key=lambda p: len(os.path.relpath(p, prefix).split(os.sep))), True
    base = {"base": prefix, "platbase": prefix, "installed_base": prefix,
            "installed_platbase": prefix}
    return sysconfig.get_path("purelib", "posix_prefix", vars=base), False


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: site_dir.py PREFIX")
    d, ok = site_dir(sys.argv[1])
    print(d)
    print("searched" if ok else "not-searched")
