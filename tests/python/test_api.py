"""The package's API: every pkv_config field as a keyword, sessions (fork, truncate,
memory, save, load, len), stats, every status as its exception with the library's
reason, lifetimes (close, context managers, garbage collection, sessions keeping their
engine alive)."""
import ctypes
import errno
import gc
import os
import subprocess
import sys
import tempfile
import textwrap
import types
import unittest
import weakref

import pkvtest
from pkvtest import np, rng

import pagedkv
from pagedkv import _lib

G = dict(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8)


def fill(s, layer, n, seed=0):
    r = rng(seed)
    for _ in range(n):
        s.append(layer, r.standard_normal((2, 8), dtype=np.float32),
                 r.standard_normal((2, 8), dtype=np.float32))


class Config(unittest.TestCase):
    def test_every_field(self):
        with tempfile.TemporaryDirectory() as tmp:
            lc = [types.SimpleNamespace(window=8, sink_tokens=1, rollback_tokens=2,
                                        softcap=30.0, sink_logits=[0.5, -1, 0, 2]),
                  {"softcap": 0}]
            with pagedkv.Engine(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                                block_tokens=4, kv_dtype="q8", scale=0.25,
                                mem_budget=1 << 20, spill_dir=tmp, n_threads=2,
                                head_dim_v=6, layer_cfg=lc, quant_dot=0,
                                prefix_cache_bytes=4096) as e:
                c = _lib.Config()
                _lib.pkv_engine_config(e._handle(), ctypes.byref(c))
                self.assertEqual((c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim,
                                  c.block_tokens, c.kv_dtype, c.scale, c.mem_budget,
                                  c.n_threads, c.head_dim_v, c.quant_dot,
                                  c.prefix_cache_bytes),
                                 (2, 4, 2, 8, 4, pagedkv.Q8, 0.25, 1 << 20, 2, 6, 0, 4096))
                self.assertEqual(os.fsdecode(c.spill_dir), tmp)
                self.assertEqual((c.layer_cfg[0].window, c.layer_cfg[0].sink_tokens,
                                  c.layer_cfg[0].rollback_tokens, c.layer_cfg[0].softcap),
                                 (8, 1, 2, 30.0))
                self.assertEqual(e.head_dim_v, 6)
                self.assertEqual(e.kv_dtype, "q8")
                st = e.stats()
                self.assertIn(st["io_backend"], ("io_uring", "sync"))
                self.assertEqual(st["mem_budget"], 1 << 20)
                with e.session() as s:
                    r = rng(9)
                    s.append(0, r.standard_normal((2, 8)), r.standard_normal((2, 6)))
                    self.assertEqual(s.decode(0, r.standard_normal((4, 8))).shape, (4, 6))

    def test_quant_dot_reaches_the_library(self):
        # accepted once the integer path is merged; until then refused, with the reason
        try:
            with pagedkv.Engine(**G, kv_dtype="q8", quant_dot=True) as e:
                c = _lib.Config()
                _lib.pkv_engine_config(e._handle(), ctypes.byref(c))
                self.assertEqual(c.quant_dot, 1)
        except pagedkv.InvalidArgument as exc:
            self.assertIn("quant_dot", str(exc))

    def test_defaults_and_struct_layout(self):
        with pagedkv.Engine(**G) as e:
            self.assertEqual(e.block_tokens, 16)
            self.assertAlmostEqual(e.scale, 1 / np.sqrt(8), places=6)
            self.assertEqual(e.head_dim_v, 8)
            st = e.stats()
            self.assertEqual(st["page_bytes"], 2 * 2 * 16 * 8 * 4)
            self.assertIn(st["pool"], ("jemalloc", "aligned"))
            self.assertEqual(st["isa"] in ("scalar", "avx2", "avx2vnni", "avx512",
                                           "avx512vnni"), True)
        # the ctypes structs end where the C ones do (a field appended to the header
        # and not here would shift nothing before it, but this catches reordering)
        self.assertEqual(ctypes.sizeof(_lib.Config), 80)
        self.assertEqual(ctypes.sizeof(_lib.Stats), 120)
        self.assertEqual(ctypes.sizeof(_lib.Memory), 56)

    def test_bad_keywords(self):
        with self.assertRaises(TypeError):
            pagedkv.Engine(n_layers=1, n_heads=1, n_kv_heads=1, head_dim=1, bogus=1)
        with self.assertRaises(ValueError):
            pagedkv.Engine(**G, kv_dtype="f8")
        with self.assertRaises(ValueError):
            pagedkv.Engine(**G, layer_cfg=[{"window": 4}])           # 1 entry, 2 layers
        with self.assertRaises(ValueError):
            pagedkv.Engine(**G, layer_cfg=[{"windw": 4}, {}])        # misspelt field
        with self.assertRaises(ValueError):
            pagedkv.Engine(**G, n_threads=-1)


class Statuses(unittest.TestCase):
    def test_einval(self):
        with self.assertRaises(pagedkv.InvalidArgument) as cm:
            pagedkv.Engine(n_layers=1, n_heads=3, n_kv_heads=2, head_dim=8)
        self.assertIsInstance(cm.exception, ValueError)
        self.assertEqual(cm.exception.status, pagedkv.EINVAL)
        self.assertIn("n_heads", str(cm.exception))                # pkv_config_explain's
        with pagedkv.Engine(**G) as e, e.session() as s:
            with self.assertRaises(pagedkv.InvalidArgument) as cm:
                s.append(5, np.zeros((2, 8)), np.zeros((2, 8)))     # bad layer
            self.assertIn("layer", str(cm.exception))

    def test_erange(self):
        with pagedkv.Engine(**G) as e, e.session() as s:
            fill(s, 0, 3)
            with self.assertRaises(pagedkv.OutOfRange) as cm:
                s.truncate(10)
            self.assertIsInstance(cm.exception, ValueError)
            self.assertEqual(len(s), 3)

    def test_enomem(self):
        page = 2 * 2 * 16 * 8 * 4
        with pagedkv.Engine(**G, mem_budget=page) as e, e.session() as s:
            fill(s, 0, 16)                                          # one page, full
            with self.assertRaises(pagedkv.OutOfMemory) as cm:
                fill(s, 1, 1)
            self.assertIsInstance(cm.exception, MemoryError)
            self.assertEqual(cm.exception.status, pagedkv.ENOMEM)
            self.assertEqual((s.len(0), s.len(1)), (16, 0))        # unchanged

    def test_estate(self):
        with pagedkv.Engine(**G) as e, e.session() as s:
            with self.assertRaises(pagedkv.StateError) as cm:
                s.decode(0, np.zeros((4, 8)))
            self.assertIsInstance(cm.exception, RuntimeError)
            self.assertIn("empty", str(cm.exception))               # the library's reason

    def test_eio_and_ecorrupt(self):
        with tempfile.TemporaryDirectory() as tmp, pagedkv.Engine(**G) as e:
            with e.session() as s:
                fill(s, 0, 20)
                fill(s, 1, 5, seed=1)
                path = os.path.join(tmp, "s.pkv")
                s.save(path)
                with self.assertRaises(pagedkv.IOFailure) as cm:
                    s.save(os.path.join(tmp, "no", "such", "dir", "s.pkv"))
                self.assertIsInstance(cm.exception, OSError)
            with self.assertRaises(pagedkv.IOFailure):
                e.load(os.path.join(tmp, "missing.pkv"))
            with open(path, "rb") as f:
                data = bytearray(f.read())
            data[len(data) - 9] ^= 0x40                             # inside the last page
            bad = os.path.join(tmp, "bad.pkv")
            with open(bad, "wb") as f:
                f.write(bytes(data))
            with self.assertRaises(pagedkv.CorruptFile) as cm:
                e.load(bad)
            self.assertEqual(cm.exception.status, pagedkv.ECORRUPT)
            self.assertIsInstance(cm.exception, OSError)
            with open(bad, "wb") as f:
                f.write(b"not a session file at all, just text" * 4)
            with self.assertRaises(pagedkv.InvalidArgument):       # wrong magic: EINVAL
                e.load(bad)

    def test_file_errors_carry_the_os_reason(self):
        # (call, path, the built-in class, errno, the library's status)
        with tempfile.TemporaryDirectory() as tmp, pagedkv.Engine(**G) as e, \
                e.session() as s:
            fill(s, 0, 3)
            plain = os.path.join(tmp, "plain")
            with open(plain, "w") as f:
                f.write("x")
            cases = [
                (e.load, os.path.join(tmp, "missing.pkv"), FileNotFoundError, errno.ENOENT,
                 pagedkv.EIO),
                (e.load, os.path.join(tmp, "no", "dir.pkv"), FileNotFoundError,
                 errno.ENOENT, pagedkv.EIO),
                (e.load, tmp, IsADirectoryError, errno.EISDIR, pagedkv.EINVAL),
                (e.load, os.path.join(plain, "x.pkv"), NotADirectoryError, errno.ENOTDIR,
                 pagedkv.EIO),
                (s.save, os.path.join(tmp, "no", "such", "s.pkv"), FileNotFoundError,
                 errno.ENOENT, pagedkv.EIO),
                (s.save, tmp, IsADirectoryError, errno.EISDIR, pagedkv.EIO),
                (s.save, os.path.join(plain, "s.pkv"), NotADirectoryError, errno.ENOTDIR,
                 pagedkv.EIO),
                (lambda p: pagedkv.Engine(**G, spill_dir=p), os.path.join(tmp, "nodir"),
                 FileNotFoundError, errno.ENOENT, pagedkv.EINVAL),
            ]
            for call, path, cls, err, status in cases:
                with self.subTest(call=getattr(call, "__name__", "Engine"), path=path):
                    with self.assertRaises(cls) as cm:
                        call(path)
                    x = cm.exception
                    self.assertIsInstance(x, pagedkv.IOFailure)
                    self.assertIsInstance(x, pagedkv.Error)
                    self.assertEqual((x.errno, x.filename, x.status), (err, path, status))
                    self.assertIn(os.strerror(err), str(x))
            self.assertEqual(os.listdir(tmp), ["plain"])        # no temporary left
            # the library's other reasons keep their classes: no errno to find
            with self.assertRaises(pagedkv.InvalidArgument) as cm:    # bad magic
                e.load(plain)
            self.assertNotIsInstance(cm.exception, OSError)
            with self.assertRaises(pagedkv.InvalidArgument):
                pagedkv.Engine(n_layers=1, n_heads=3, n_kv_heads=2, head_dim=8,
                               spill_dir=tmp)

    def test_permission_errors(self):
        # as root, in a child that drops to nobody (root may write anywhere)
        code = textwrap.dedent("""
            import errno, os, sys
            try:
                import numpy as np, pagedkv
            except (ImportError, OSError) as exc:    # the tree is not readable by nobody
                print(exc, file=sys.stderr)
                sys.exit(3)
            tmp = sys.argv[1]
            with pagedkv.Engine(n_layers=1, n_heads=1, n_kv_heads=1, head_dim=4) as e:
                s = e.session()
                s.append(0, np.ones((1, 4)), np.ones((1, 4)))
                for call, path in ((s.save, os.path.join(tmp, "locked", "s.pkv")),
                                   (e.load, os.path.join(tmp, "secret.pkv"))):
                    try:
                        call(path)
                    except PermissionError as x:
                        assert isinstance(x, pagedkv.IOFailure), type(x)
                        assert (x.errno, x.filename) == (errno.EACCES, path), x
                        print(type(x).__name__, x.status)
                    else:
                        raise AssertionError(f"{call.__name__}({path}) succeeded")
        """)
        with tempfile.TemporaryDirectory() as tmp, pagedkv.Engine(**G) as e, \
                e.session() as s:
            fill(s, 0, 3)
            s.save(os.path.join(tmp, "secret.pkv"))            # mode 0600
            os.mkdir(os.path.join(tmp, "locked"), 0o555)
            os.chmod(tmp, 0o755)
            kw = {}
            if os.geteuid() == 0:
                kw["preexec_fn"] = lambda: (os.setgid(65534), os.setuid(65534))
                os.chown(os.path.join(tmp, "secret.pkv"), 0, 0)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
            r = subprocess.run([sys.executable, "-c", code, tmp], capture_output=True,
                               text=True, env=env, **kw)
            if r.returncode == 3 and kw:
                self.skipTest(f"user nobody cannot import pagedkv here: {r.stderr.strip()}")
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(r.stdout.split(), ["PermissionDenied", str(pagedkv.EIO)] * 2)

    def test_every_status_has_its_class(self):
        expect = {pagedkv.EINVAL: (pagedkv.InvalidArgument, ValueError),
                  pagedkv.ERANGE: (pagedkv.OutOfRange, ValueError),
                  pagedkv.ENOMEM: (pagedkv.OutOfMemory, MemoryError),
                  pagedkv.EIO: (pagedkv.IOFailure, OSError),
                  pagedkv.ECORRUPT: (pagedkv.CorruptFile, OSError),
                  pagedkv.ESTATE: (pagedkv.StateError, RuntimeError)}
        for status, (cls, base) in expect.items():
            with self.assertRaises(cls) as cm:
                _lib.raise_for(status, "call", "why")
            self.assertIsInstance(cm.exception, base)
            self.assertIsInstance(cm.exception, pagedkv.Error)
            self.assertEqual(str(cm.exception), f"call: {pagedkv.status_str(status)} (why)")


class Sessions(unittest.TestCase):
    def test_fork_truncate_memory(self):
        with pagedkv.Engine(**G) as e:
            s = e.session()
            fill(s, 0, 40)
            fill(s, 1, 40, seed=1)
            m = s.memory()
            self.assertEqual(m["tokens"], 80)
            self.assertEqual(m["blocks"], 6)                        # ceil(40/16) * 2
            self.assertEqual(m["bytes_resident"], 6 * e.stats()["page_bytes"])
            self.assertEqual(m["bytes_ideal"], 80 * 2 * 2 * 8 * 4)
            f = s.fork()
            self.assertEqual(f.memory()["bytes_shared"], m["bytes_resident"])
            self.assertEqual(e.stats()["pages_in_use"], 6)
            q = rng(3).standard_normal((4, 8), dtype=np.float32)
            self.assertTrue(np.array_equal(f.decode(0, q), s.decode(0, q)))
            f.truncate(17)
            self.assertEqual((f.len(0), f.len(1), len(s)), (17, 17, 40))
            f.close()
            s.close()
            self.assertEqual(e.stats()["pages_in_use"], 0)

    def test_save_load_roundtrip(self):
        with tempfile.TemporaryDirectory() as tmp, \
                pagedkv.Engine(**G, kv_dtype="bf16") as e:
            s = e.session()
            fill(s, 0, 33)
            fill(s, 1, 7, seed=2)
            path = os.path.join(tmp, "s.pkv")
            s.save(path)
            self.assertEqual(os.stat(path).st_mode & 0o777, 0o600)
            t = e.load(path)
            self.assertEqual((t.len(0), t.len(1)), (33, 7))
            self.assertEqual(len(pagedkv.Session.load(e, path)), 33)
            q = rng(4).standard_normal((4, 8), dtype=np.float32)
            for layer in (0, 1):
                self.assertTrue(np.array_equal(t.decode(layer, q), s.decode(layer, q)))

    @unittest.skipUnless(pagedkv.HAVE_PREFIX, "the library has no prefix cache yet")
    def test_prefix(self):
        with pagedkv.Engine(**G, prefix_cache_bytes=1 << 20) as e:
            s = e.session()
            fill(s, 0, 32)
            fill(s, 1, 32, seed=1)
            s.set_tokens(list(range(32)))
            t, n = e.from_prefix(list(range(40)))
            self.assertEqual(n, 32)
            self.assertEqual(t.len(0), 32)


class Speculative(unittest.TestCase):
    """Session.verify and Session.commit (docs/speculative.md): a tree's drafts get the
    bits of append + decode along their paths, a commit keeps one path, bad trees and
    paths are the library's statuses with nothing changed."""

    def test_verify_commit_bitwise(self):
        parent = [-1, 0, 0, 1, 3, -1]
        r = rng(7)
        with pagedkv.Engine(**G, block_tokens=4, kv_dtype="f16") as e:
            s = e.session()
            fill(s, 0, 9)
            fill(s, 1, 9, seed=1)
            base = s.fork()
            n = len(parent)
            q = r.standard_normal((2, n, 4, 8), dtype=np.float32)
            k = r.standard_normal((2, n, 2, 8), dtype=np.float32)
            v = r.standard_normal((2, n, 2, 8), dtype=np.float32)
            out = [s.verify(layer, parent, q[layer], k[layer], v[layer]) for layer in (0, 1)]
            self.assertEqual(len(s), 9)                          # pending, not cached
            self.assertGreater(e.stats()["pages_read_shared"], 0)

            def path_to(i):
                p = []
                while i >= 0:
                    p.append(i)
                    i = parent[i]
                return p[::-1]
            for i in range(n):                                   # every draft
                with base.fork() as t:
                    for j in path_to(i):
                        t.append(0, k[0, j], v[0, j])
                    self.assertTrue(np.array_equal(t.decode(0, q[0, i]), out[0][i]))
            with self.assertRaises(pagedkv.InvalidArgument):
                s.commit([1, 3])                                 # not from a root
            with self.assertRaises(pagedkv.StateError):
                s.fork()                                         # drafts pending
            s.commit(path_to(4))
            self.assertEqual(len(s), 9 + 4)
            with self.assertRaises(pagedkv.StateError):
                s.commit([0])                                    # nothing pending
            with base.fork() as t:
                for layer in (0, 1):
                    for j in path_to(4):
                        t.append(layer, k[layer, j], v[layer, j])
                qq = r.standard_normal((4, 8), dtype=np.float32)
                for layer in (0, 1):
                    self.assertTrue(np.array_equal(t.decode(layer, qq), s.decode(layer, qq)))
            e.check()

    def test_bad_trees(self):
        with pagedkv.Engine(**G) as e, e.session() as s:
            fill(s, 0, 3)
            z = np.zeros
            for bad in ([0], [-1, 1], [-2], [-1, 5]):
                n = len(bad)
                with self.assertRaises(pagedkv.InvalidArgument):
                    s.verify(0, bad, z((n, 4, 8)), z((n, 2, 8)), z((n, 2, 8)))
            with self.assertRaises((pagedkv.InvalidArgument, ValueError)):
                s.verify(0, [], z((0, 4, 8)), z((0, 2, 8)), z((0, 2, 8)))
            with self.assertRaises(ValueError):
                s.verify(0, [-1, 0], z((1, 4, 8)), z((2, 2, 8)), z((2, 2, 8)))  # shapes
            self.assertEqual(s.memory()["blocks"], 1)            # nothing changed
            s.verify(0, [-1, 0], z((2, 4, 8)), z((2, 2, 8)), z((2, 2, 8)))
            s.commit()                                           # drop them all
            self.assertEqual(len(s), 3)


class Lifetime(unittest.TestCase):
    def test_session_keeps_engine_alive(self):
        e = pagedkv.Engine(**G)
        s = e.session()
        fill(s, 0, 5)
        ref = weakref.ref(e)
        del e
        gc.collect()
        self.assertIsNotNone(ref())                                 # s holds it
        self.assertEqual(s.decode(0, np.ones((4, 8))).shape, (4, 8))
        del s
        gc.collect()
        self.assertIsNone(ref())                                    # both collected

    def test_gc_frees_pages(self):
        with pagedkv.Engine(**G) as e:
            for i in range(50):
                s = e.session()
                fill(s, 0, 20)
                f = s.fork()
                f.append(0, np.ones((2, 8)), np.ones((2, 8)))
                del s, f                                            # no close(): GC
            gc.collect()
            self.assertEqual(e.stats()["pages_in_use"], 0)
            e.check()

    def test_close_is_idempotent_and_closes_sessions(self):
        e = pagedkv.Engine(**G)
        s = e.session()
        fill(s, 0, 3)
        e.close()
        e.close()
        self.assertTrue(s.closed and e.closed)
        with self.assertRaisesRegex(ValueError, "closed"):
            s.decode(0, np.ones((4, 8)))
        with self.assertRaisesRegex(ValueError, "closed"):
            e.session()
        s.close()

    @unittest.skipIf(os.environ.get("PKV_SANITIZER_PRELOAD"),
                     "RSS says nothing under a sanitizer (quarantine, shadow memory)")
    def test_no_growth_over_cycles(self):
        def rss_kib():
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1])
            return 0
        cycle = lambda: [fill(s, 0, 40) for s in [pagedkv.Engine(**G).session()]]
        for _ in range(100):
            cycle()
        gc.collect()
        before = rss_kib()
        for _ in range(300 if pkvtest.QUICK else 1000):
            cycle()
        gc.collect()
        self.assertLess(rss_kib() - before, 2048, "RSS grew over engine/session cycles")


if __name__ == "__main__":
    pkvtest.run()
