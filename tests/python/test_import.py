"""`import pagedkv` in a fresh interpreter with a clean environment (no LD_PRELOAD):
libpagedkv.so loads with dlopen on a stock system and reports its pool; jemalloc, when
pagedkv loads it privately, never becomes the process's malloc; with jemalloc preloaded
the pool uses the process's. Also: libpagedkv.so does not need libjemalloc.so.2."""
import os
import subprocess
import sys
import unittest

import pkvtest  # noqa: F401  (SKIP without numpy)

LIB = os.environ.get("PAGEDKV_LIBRARY", "")
PYPATH = os.environ.get("PYTHONPATH", "")
BUILT_WITH_JEMALLOC = os.environ.get("PKV_JEMALLOC") == "1"

PROBE = r"""
import ctypes, pagedkv, numpy as np
pool = pagedkv.pool()
with pagedkv.Engine(n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4) as e, e.session() as s:
    for t in range(40):
        s.append(0, np.full((1, 4), t, np.float32), np.full((1, 4), t, np.float32))
    out = s.decode(0, np.zeros((2, 4)))
    assert abs(out[0, 0] - 19.5) < 1e-4, out
# is jemalloc the process's malloc? (in the global scope: dlsym(RTLD_DEFAULT, "mallctl"))
process = hasattr(ctypes.CDLL(None), "mallctl")
print(pool, "process-jemalloc" if process else "process-libc")
"""


def probe(**extra):
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": PYPATH,
           "PAGEDKV_LIBRARY": LIB, "PYTHONDONTWRITEBYTECODE": "1"}
    # a sanitizer build's runtime (tests/meson.build), never an allocator
    san = os.environ.get("PKV_SANITIZER_PRELOAD")
    if san:
        env["LD_PRELOAD"] = san
        for name in ("ASAN_OPTIONS", "TSAN_OPTIONS"):
            if name in os.environ:
                env[name] = os.environ[name]
    if "LD_PRELOAD" in extra and san:
        extra = dict(extra, LD_PRELOAD=san + ":" + extra["LD_PRELOAD"])
    env.update(extra)
    r = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                       text=True)
    if r.returncode != 0:
        raise AssertionError(f"fresh interpreter failed ({r.returncode}):\n{r.stderr}")
    return r.stdout.split()


def jemalloc_path():
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib",
              "/lib/x86_64-linux-gnu"):
        p = os.path.join(d, "libjemalloc.so.2")
        if os.path.exists(p):
            return p
    return None


class Import(unittest.TestCase):
    def test_library_does_not_need_jemalloc(self):
        needed = _needed(LIB)
        self.assertIn(b"libc.so", needed)
        self.assertNotIn(b"libjemalloc", needed)

    def test_fresh_interpreter_no_preload(self):
        pool, process = probe()
        self.assertIn(pool, ("jemalloc", "aligned"))
        self.assertEqual(process, "process-libc")   # pagedkv never swaps the malloc
        if not BUILT_WITH_JEMALLOC:
            self.assertEqual(pool, "aligned")
        print(f"\nfresh interpreter: pool {pool}, {process}", file=sys.stderr)

    @unittest.skipUnless(BUILT_WITH_JEMALLOC and jemalloc_path(), "no jemalloc")
    def test_private_jemalloc(self):
        # enough static TLS for Debian's jemalloc: pagedkv's private dlopen succeeds,
        # and its malloc stays out of the process (RTLD_LOCAL)
        pool, process = probe(GLIBC_TUNABLES="glibc.rtld.optional_static_tls=16384")
        self.assertEqual((pool, process), ("jemalloc", "process-libc"))

    @unittest.skipUnless(BUILT_WITH_JEMALLOC and jemalloc_path(), "no jemalloc")
    def test_preloaded_jemalloc(self):
        pool, process = probe(LD_PRELOAD=jemalloc_path())
        self.assertEqual((pool, process), ("jemalloc", "process-jemalloc"))


def _needed(path):
    return b" ".join(elf_dynamic(path, 1))                  # DT_NEEDED


def elf_dynamic(path, tag):
    """The strings of one tag of an ELF shared object's dynamic section (1 DT_NEEDED,
    14 DT_SONAME), read with the standard library."""
    import struct
    with open(path, "rb") as f:
        elf = f.read()
    assert elf[:4] == b"\x7fELF" and elf[4] == 2, "a 64-bit ELF"
    e_shoff, = struct.unpack_from("<Q", elf, 0x28)
    e_shentsize, e_shnum = struct.unpack_from("<HH", elf, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", elf, e_shoff + i * e_shentsize)
            for i in range(e_shnum)]
    dyn = next(s for s in secs if s[1] == 6)            # SHT_DYNAMIC
    strtab = secs[dyn[6]]                               # sh_link: its string table
    names = []
    for off in range(dyn[4], dyn[4] + dyn[5], 16):
        t, val = struct.unpack_from("<qQ", elf, off)
        if t == tag:
            end = elf.index(b"\0", strtab[4] + val)
            names.append(elf[strtab[4] + val:end])
    return names

if __name__ == "__main__":
    pkvtest.run()
