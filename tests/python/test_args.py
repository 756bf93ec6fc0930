"""Every value the package hands to the C library is checked first: ctypes would wrap
an integer modulo 2**32 or 2**64, truncate a float to an int, turn a float the C float
cannot hold into inf or 0, and cut a path at a NUL byte. This walks every public method
and function with out-of-range and wrong-typed arguments, asserts the exception class
(TypeError, ValueError or OverflowError, as pagedkv/_args.py says) and that the session
and the engine are exactly as they were (lengths, memory, decode results bit for bit,
page counters, and the library's last error: the library was not even called).

A public method that this file does not cover fails test_every_public_method_covered."""
import math
import os
import tempfile
import unittest

import pkvtest
from pkvtest import np, rng

import pagedkv

G = dict(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8)
K = np.ones((2, 8), dtype=np.float32)
Q = np.ones((4, 8), dtype=np.float32)

# bad values of each kind, with the exception each must raise
BAD_U32 = [(-1, ValueError), (-2**63, ValueError), (2**32, OverflowError),
           (2**32 + 1, OverflowError), (2**64 + 3, OverflowError), (1.0, TypeError),
           (1.9, TypeError), (np.float64(1), TypeError), (True, TypeError),
           (np.bool_(True), TypeError), ("1", TypeError), (None, TypeError),
           (complex(1, 0), TypeError), (np.array([1, 2]), TypeError)]
BAD_U64 = [(-1, ValueError), (2**64, OverflowError), (2**64 + 3, OverflowError),
           (2**70, OverflowError), (3.0, TypeError), (False, TypeError), ("3", TypeError),
           (None, TypeError)]
BAD_FLOAT = [(math.nan, ValueError), (math.inf, ValueError), (-math.inf, ValueError),
             (1e39, OverflowError), (1e-50, OverflowError), (True, TypeError),
             ("0.5", TypeError), (None, TypeError), (complex(0.5, 1), TypeError)]
BAD_TOKENS = [([1.9, 2.2], TypeError), (np.array([1.0, 2.0]), TypeError),
              ([True, False], TypeError), ("ab", TypeError), (b"ab", TypeError),
              ([2**31], OverflowError), ([1, -2**31 - 1], OverflowError),
              ([2**64 + 1], OverflowError), (np.array([2**40]), OverflowError),
              (np.array([2**32 + 1], dtype=np.uint64), OverflowError),
              ([[1, 2]], ValueError), (5, ValueError), ([1, None], TypeError)]
BAD_PATH = [("a\0b.pkv", ValueError), (b"a\0b.pkv", ValueError), (123, TypeError),
            (None, TypeError)]


def bad_arrays(shape):
    """Arrays the library must never see, for a float32 input of `shape`."""
    n = int(np.prod(shape))
    return [(np.ones(shape, dtype=np.complex64), TypeError),
            (np.full(shape, "1.5"), TypeError),
            (np.ones(shape, dtype=bool), TypeError),
            (np.full(shape, None, dtype=object), TypeError),
            (np.full(shape, 1e39), OverflowError),           # finite, beyond float32
            (np.ones((n + 1,), dtype=np.float32), ValueError),
            (np.ones(shape + (1,), dtype=np.float32), ValueError),
            (np.ones(shape[::-1] if len(shape) > 1 and shape[0] != shape[-1]
                     else (n, 2), dtype=np.float32), ValueError)]


def snapshot(e, sessions):
    """Everything a call could have changed, as comparable values."""
    state = {"stats": {k: v for k, v in e.stats().items()
                       if k in ("pages_in_use", "pages_free", "pages_spilled",
                                "pages_cached", "prefix_lookups", "prefix_hit_tokens")},
             "last_error": e.last_error()}
    for i, s in enumerate(sessions):
        if s.closed:
            state[i] = "closed"
            continue
        state[i] = {"len": [s.len(l) for l in range(e.n_layers)], "memory": s.memory(),
                    "decode": [s.decode(l, Q).tobytes() if s.len(l) else None
                               for l in range(e.n_layers)]}
    return state


class Arguments(unittest.TestCase):
    def setUp(self):
        self.e = pagedkv.Engine(**G, prefix_cache_bytes=1 << 20)
        self.s = self.e.session()
        r = rng(7)
        for t in range(10):
            self.s.append(0, r.standard_normal((2, 8)), r.standard_normal((2, 8)))
        self.s.append(1, K, K)
        if pagedkv.HAVE_PREFIX:
            self.s.set_tokens([5])
        self.f = self.s.fork()
        # a known last error: a refused call must leave it as it is
        with self.assertRaises(pagedkv.StateError):
            self.e.session().decode(1, Q)
        self.tmp = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.tmp.name, "s.pkv")
        self.s.save(self.path)

    def tearDown(self):
        self.e.close()
        self.tmp.cleanup()

    def refused(self, name, call, cases, library=False):
        """call(bad) raises the expected class for each case; nothing changes (but the
        library's last error when the library itself refuses: library=True)."""
        before = snapshot(self.e, [self.s, self.f])
        for bad, exc in cases:
            with self.subTest(call=name, value=repr(bad)[:60]):
                with self.assertRaises(exc) as cm:
                    call(bad)
                # the narrower class, never its sibling (an OverflowError for a
                # negative count, a TypeError for 2**32)
                for other in {TypeError, ValueError, OverflowError} - {exc}:
                    if not issubclass(exc, other):
                        self.assertNotIsInstance(cm.exception, other, str(cm.exception))
                after = snapshot(self.e, [self.s, self.f])
                if library:
                    self.assertNotEqual(after.pop("last_error"), before["last_error"])
                    after["last_error"] = before["last_error"]
                self.assertEqual(after, before)

    # -- Session ----------------------------------------------------------------------
    def test_session_layers(self):
        s = self.s
        calls = {"append": lambda l: s.append(l, K, K),
                 "decode": lambda l: s.decode(l, Q),
                 "prefill": lambda l: s.prefill(l, Q[None], K[None], K[None]),
                 "len": lambda l: s.len(l),
                 "decode_batch": lambda l: self.e.decode_batch(l, [s], Q[None])}
        for name, call in calls.items():
            self.refused(name, call, BAD_U32)
        # the library's own range check, through its status
        self.refused("append", lambda l: s.append(l, K, K),
                     [(2, pagedkv.InvalidArgument), (2**32 - 1, pagedkv.InvalidArgument)],
                     library=True)
        self.refused("len", lambda l: s.len(l), [(2, pagedkv.InvalidArgument)])

    def test_session_arrays(self):
        s = self.s
        self.refused("append k", lambda a: s.append(0, a, K), bad_arrays((2, 8)))
        self.refused("append v", lambda a: s.append(0, K, a), bad_arrays((2, 8)))
        self.refused("decode q", lambda a: s.decode(0, a), bad_arrays((4, 8)))
        self.refused("prefill k", lambda a: s.prefill(0, Q[None], a, K[None]),
                     bad_arrays((1, 2, 8)))
        self.refused("prefill v", lambda a: s.prefill(0, Q[None], K[None], a),
                     bad_arrays((1, 2, 8)))
        self.refused("decode_batch q", lambda a: self.e.decode_batch(0, [s], a),
                     bad_arrays((1, 4, 8)))
        outs = [(np.empty((4, 8)), ValueError), (np.empty((4, 8), np.float32)[:, ::2],
                                                  ValueError),
                (np.empty(33, np.float32), ValueError), ([0.0] * 32, ValueError)]
        self.refused("decode out", lambda o: s.decode(0, Q, out=o), outs)
        q = Q.copy()
        self.refused("decode out aliasing q", lambda o: s.decode(0, q, out=o), [(q, ValueError)])
        self.refused("prefill out", lambda o: s.prefill(0, Q[None], K[None], K[None], out=o),
                     outs)

    def test_speculative(self):
        s, P = self.s, [-1]
        self.refused("verify layer", lambda l: s.verify(l, P, Q[None], K[None], K[None]),
                     BAD_U32)
        self.refused("verify parent", lambda p: s.verify(0, p, Q[None], K[None], K[None]),
                     BAD_TOKENS)
        self.refused("verify q", lambda a: s.verify(0, P, a, K[None], K[None]),
                     bad_arrays((1, 4, 8)))
        self.refused("verify k", lambda a: s.verify(0, P, Q[None], a, K[None]),
                     bad_arrays((1, 2, 8)))
        self.refused("verify v", lambda a: s.verify(0, P, Q[None], K[None], a),
                     bad_arrays((1, 2, 8)))
        self.refused("commit path", s.commit,
                     [([-1], ValueError), ([2**32], OverflowError), ([1.0], TypeError),
                      ("ab", TypeError), ([[0]], ValueError), ([True], TypeError),
                      (np.array([0.5]), TypeError)])
        # the library's own checks, through its status
        self.refused("verify tree", lambda p: s.verify(0, p, Q[None], K[None], K[None]),
                     [([0], pagedkv.InvalidArgument), ([-2], pagedkv.InvalidArgument)],
                     library=True)
        self.refused("commit", s.commit, [([0], pagedkv.StateError)], library=True)

    def test_truncate(self):
        self.refused("truncate", self.s.truncate, BAD_U64)
        # the report's case: 2**64 + 3 used to truncate a 10-token session to 3
        self.assertEqual(self.s.len(0), 10)

    def test_discard_rope_q(self):
        self.refused("discard p0", lambda v: self.s.discard(v, 0), BAD_U64)
        self.refused("discard p1", lambda v: self.s.discard(0, v), BAD_U64)
        self.refused("rope_q layer", lambda v: self.e.rope_q(v, Q.reshape(1, 4, 8), [0]),
                     BAD_U64)
        self.refused("rope_q pos", lambda v: self.e.rope_q(0, Q.reshape(1, 4, 8), v),
                     [([-1], ValueError), ([1.5], TypeError), (["a"], TypeError)])
        self.assertEqual(self.s.len(0), 10)

    def test_tokens(self):
        if not pagedkv.HAVE_PREFIX:
            self.skipTest("the library has no prefix cache")
        self.refused("set_tokens", self.s.set_tokens, BAD_TOKENS)
        self.refused("from_prefix", self.e.from_prefix, BAD_TOKENS)
        # numpy integers of any width, in range, are fine (layer 1 holds one position)
        self.s.set_tokens(np.array([5], dtype=np.int64))
        self.s.set_tokens([np.int16(5)])
        self.s.append(1, K, K)
        self.s.set_tokens([np.int16(5), np.uint8(6)])
        t, n = self.e.from_prefix(np.array([5, 6, 7, 8], dtype=np.uint32))
        self.assertEqual(n, 0)      # fewer tokens than one page of 16
        t.close()

    def test_paths(self):
        self.refused("save", self.s.save, BAD_PATH)
        self.refused("load", self.e.load, BAD_PATH)
        self.refused("Session.load", lambda p: pagedkv.Session.load(self.e, p), BAD_PATH)
        self.refused("Session.load engine", lambda e: pagedkv.Session.load(e, self.path),
                     [(None, TypeError), (self.s, TypeError)])
        self.assertFalse(os.path.exists(os.path.join(self.tmp.name, "a")))

    def test_decode_batch_sessions(self):
        other = pagedkv.Engine(**G)
        try:
            o = other.session()
            o.append(0, K, K)
            self.refused("decode_batch sessions", lambda ss: self.e.decode_batch(0, ss, Q[None]),
                         [([o], ValueError), ([None], ValueError), (self.s, TypeError),
                          ([self.s, self.f], ValueError)])   # 2 sessions, 1 query
        finally:
            other.close()

    # -- Engine -----------------------------------------------------------------------
    def test_engine_config(self):
        fields = {"n_layers": BAD_U32, "n_heads": BAD_U32, "n_kv_heads": BAD_U32,
                  "head_dim": BAD_U32, "block_tokens": BAD_U32, "n_threads": BAD_U32,
                  "head_dim_v": BAD_U32, "mem_budget": BAD_U64,
                  "prefix_cache_bytes": BAD_U64, "scale": BAD_FLOAT,
                  "quant_dot": [(-1, ValueError), (2**32 + 1, OverflowError),
                                (0.0, TypeError), ("1", TypeError)],
                  "kv_dtype": [(2**32 + 1, OverflowError), (1.0, TypeError),
                               (True, TypeError), ("f8", ValueError), (None, TypeError)],
                  "spill_dir": BAD_PATH[:3]}
        for field, cases in fields.items():
            self.refused(f"Engine({field})", lambda v: pagedkv.Engine(**dict(G, **{field: v})),
                         cases)
        lc_fields = {"window": BAD_U32, "sink_tokens": BAD_U32,
                     "rollback_tokens": BAD_U32, "softcap": BAD_FLOAT,
                     "sink_logits": bad_arrays((4,))}
        for field, cases in lc_fields.items():
            self.refused(f"layer_cfg {field}",
                         lambda v: pagedkv.Engine(**G, layer_cfg=[{field: v}, {}]),
                         [(v, e) for v, e in cases if v is not None])
        self.refused("layer_cfg", lambda v: pagedkv.Engine(**G, layer_cfg=v),
                     [({"window": 4}, TypeError), (["window", "softcap"], TypeError),
                      ([1, 2], TypeError), ([{}], ValueError)])
        # the report's case: a window of -1 used to be 4294967295
        with self.assertRaises(ValueError):
            pagedkv.Engine(**G, layer_cfg=[{"window": -1}, {}])

    def test_numpy_integers_accepted(self):
        with pagedkv.Engine(n_layers=np.uint32(2), n_heads=np.int64(4), n_kv_heads=np.int8(2),
                            head_dim=np.uint16(8), mem_budget=np.uint64(2**63),
                            scale=np.float32(0.25), quant_dot=False) as e, e.session() as s:
            s.append(np.int64(1), K, K)
            self.assertEqual(s.len(np.uint8(1)), 1)
            s.truncate(np.uint64(0))
            self.assertEqual(s.len(1), 0)
            self.assertEqual(e.scale, 0.25)

    # -- functions --------------------------------------------------------------------
    def test_functions(self):
        args = [32, 8, 128, 8192, 1, 2]
        for i in range(6):
            def call(v, i=i):
                a = list(args)
                a[i] = v
                return pagedkv.kv_cache_bytes(*a)
            self.refused(f"kv_cache_bytes[{i}]", call, BAD_U64)
        q = rng(1).standard_normal((5, 2, 4), dtype=np.float32)
        k = rng(2).standard_normal((5, 1, 4), dtype=np.float32)
        self.refused("causal_attention scale",
                     lambda v: pagedkv.causal_attention(q, k, k, scale=v), BAD_FLOAT)
        self.refused("causal_attention Q", lambda a: pagedkv.causal_attention(a, k, k),
                     bad_arrays((5, 2, 4))[:5])
        self.refused("causal_attention K", lambda a: pagedkv.causal_attention(q, a, k),
                     bad_arrays((5, 1, 4))[:5])
        x = rng(3).standard_normal((3, 8), dtype=np.float32)
        w = np.ones((8, 8), dtype=np.float32)
        self.refused("multi_head_attention n_heads",
                     lambda v: pagedkv.multi_head_attention(x, w, w, w, w, v),
                     BAD_U32 + [(0, ValueError)])
        self.refused("multi_head_attention n_kv_heads",
                     lambda v: pagedkv.multi_head_attention(x, w, w, w, w, 2, v),
                     [c for c in BAD_U32 if c[0] is not None] + [(0, ValueError)])
        self.refused("multi_head_attention X",
                     lambda a: pagedkv.multi_head_attention(a, w, w, w, w, 2),
                     bad_arrays((3, 8))[:5])
        self.refused("status_str", pagedkv.status_str,
                     [(2**32 + 1, OverflowError), (1.0, TypeError), (True, TypeError)])

    def test_every_public_method_covered(self):
        covered = {
            "Engine": {"session", "load", "from_prefix", "decode_batch", "stats", "check", "rope_q",
                       "last_error", "close", "closed"},
            "Session": {"append", "decode", "prefill", "fork", "truncate", "len", "memory",
                        "load", "save", "set_tokens", "close", "closed", "engine", "discard",
                        "verify", "commit"},
        }
        # no arguments, or none that reach C: fork, memory, stats, check, last_error,
        # close, closed, engine (test_lifetime covers them on closed objects)
        for cls in (pagedkv.Engine, pagedkv.Session):
            public = {n for n in dir(cls) if not n.startswith("_")}
            self.assertEqual(public - covered[cls.__name__], set(),
                             f"{cls.__name__}: public methods this test does not walk")
        functions = {n for n in pagedkv.__all__ if callable(getattr(pagedkv, n)) and
                     not isinstance(getattr(pagedkv, n), type)}
        self.assertEqual(functions - {"kv_cache_bytes", "causal_attention",
                                      "multi_head_attention", "status_str", "version",
                                      "pool"}, set())


if __name__ == "__main__":
    pkvtest.run()
