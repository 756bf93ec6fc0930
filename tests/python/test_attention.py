"""Attention through the Python package against numpy float64 references: GQA, MHA and
MQA decode across page boundaries, prefill, decode_batch, causal attention, the textbook
layer and its errors, the size formula; and bitwise equality between the package and
the library called directly (ctypes on raw pointers), for every input form."""
import ctypes
import unittest

import pkvtest
from pkvtest import np, ref_attention, ref_mha, rng

import pagedkv
from pagedkv import _lib

GEOMETRIES = [  # (h, g, d): GQA, MHA, MQA, odd head_dim
    (8, 2, 16), (4, 4, 8), (8, 1, 17), (6, 3, 3), (2, 1, 64)]


def tol(v):
    return 1e-5 * max(1.0, float(np.max(np.abs(v))))


class Decode(unittest.TestCase):
    def test_decode_matches_reference(self):
        for n, (h, g, d) in enumerate(GEOMETRIES):
            for bt in (1, 16):
                with self.subTest(h=h, g=g, d=d, bt=bt):
                    r = rng(n * 10 + bt)
                    T = 40 if pkvtest.QUICK else 70   # past several pages at bt 16
                    q = r.standard_normal((T, h, d), dtype=np.float32)
                    k = r.standard_normal((T, g, d), dtype=np.float32)
                    v = r.standard_normal((T, g, d), dtype=np.float32)
                    ref = ref_attention(q, k, v)
                    with pagedkv.Engine(n_layers=2, n_heads=h, n_kv_heads=g, head_dim=d,
                                        block_tokens=bt, n_threads=2) as e, \
                            e.session() as s:
                        for t in range(T):
                            s.append(1, k[t], v[t])
                            out = s.decode(1, q[t])
                            self.assertEqual(out.shape, (h, d))
                            err = np.max(np.abs(out - ref[t]))
                            self.assertLessEqual(err, tol(v), f"t={t}")
                        self.assertEqual(s.len(1), T)
                        self.assertEqual(s.len(0), 0)

    def test_prefill_and_batch_are_bitwise_decode(self):
        h, g, d, T = 8, 2, 32, 37
        r = rng(1)
        q = r.standard_normal((T, h, d), dtype=np.float32)
        k = r.standard_normal((T, g, d), dtype=np.float32)
        v = r.standard_normal((T, g, d), dtype=np.float32)
        with pagedkv.Engine(n_layers=1, n_heads=h, n_kv_heads=g, head_dim=d) as e:
            a, b = e.session(), e.session()
            single = np.stack([(a.append(0, k[t], v[t]), a.decode(0, q[t]))[1]
                               for t in range(T)])
            pre = b.prefill(0, q, k, v)
            self.assertTrue(np.array_equal(single, pre))
            self.assertLessEqual(np.max(np.abs(pre - ref_attention(q, k, v))), tol(v))
            forks = [a.fork() for _ in range(3)]
            qb = r.standard_normal((4, h, d), dtype=np.float32)
            batch = e.decode_batch(0, [a] + forks, qb)
            for i, s in enumerate([a] + forks):
                self.assertTrue(np.array_equal(batch[i], s.decode(0, qb[i])))

    def test_window_and_head_dim_v(self):
        h, g, d, dv, T, W, S = 4, 2, 8, 5, 50, 7, 2
        r = rng(2)
        q = r.standard_normal((T, h, d), dtype=np.float32)
        k = r.standard_normal((T, g, d), dtype=np.float32)
        v = r.standard_normal((T, g, dv), dtype=np.float32)
        ref = ref_attention(q, k, v, window=W, sink_tokens=S)
        cfg = [{"window": W, "sink_tokens": S}]
        with pagedkv.Engine(n_layers=1, n_heads=h, n_kv_heads=g, head_dim=d, head_dim_v=dv,
                            block_tokens=4, layer_cfg=cfg) as e, e.session() as s:
            out = s.prefill(0, q, k, v)
            self.assertEqual(out.shape, (T, h, dv))
            self.assertLessEqual(np.max(np.abs(out - ref)), tol(v))


class Dense(unittest.TestCase):
    def test_causal_attention(self):
        for n, (h, g, d) in enumerate(GEOMETRIES):
            with self.subTest(h=h, g=g, d=d):
                r = rng(100 + n)
                T = 12
                q = r.standard_normal((T, h, d), dtype=np.float32)
                k = r.standard_normal((T, g, d), dtype=np.float32)
                v = r.standard_normal((T, g, d), dtype=np.float32)
                out = pagedkv.causal_attention(q, k, v)
                self.assertEqual(out.dtype, np.float32)
                self.assertLessEqual(np.max(np.abs(out - ref_attention(q, k, v))), tol(v))
        with self.assertRaises(ValueError):
            pagedkv.causal_attention(np.zeros((2, 3, 4)), np.zeros((2, 2, 4)), np.zeros((2, 2, 4)))

    def test_causal_attention_single_head_2d(self):
        # the textbook's form: Q, K, V [T][d], one head -> [T][d]
        for T, d in ((1, 4), (12, 16), (33, 7)):
            with self.subTest(T=T, d=d):
                r = rng(300 + T)
                q = r.standard_normal((T, d), dtype=np.float32)
                k = r.standard_normal((T, d), dtype=np.float32)
                v = r.standard_normal((T, d), dtype=np.float32)
                out = pagedkv.causal_attention(q, k, v)
                self.assertEqual(out.shape, (T, d))
                ref = ref_attention(q[:, None], k[:, None], v[:, None])[:, 0]
                self.assertLessEqual(np.max(np.abs(out - ref)), tol(v))
                # bit for bit the one-head case of the multi-head form
                three = pagedkv.causal_attention(q[:, None], k[:, None], v[:, None])
                self.assertTrue(np.array_equal(out, three[:, 0]))
                self.assertTrue(np.array_equal(
                    pagedkv.causal_attention(q.tolist(), k.tolist(), v.tolist(), scale=0.5),
                    pagedkv.causal_attention(q, k, v, scale=0.5)))
        x2, x3 = np.ones((3, 4)), np.ones((3, 1, 4))
        with self.assertRaisesRegex(ValueError, r"all be \[T\]\[d\]"):
            pagedkv.causal_attention(x2, x3, x3)                      # forms mixed
        with self.assertRaises(ValueError):
            pagedkv.causal_attention(x2, np.ones((4, 4)), np.ones((4, 4)))    # T differs
        with self.assertRaises(ValueError):
            pagedkv.causal_attention(x2, x2, np.ones((3, 5)))          # V's d differs

    def test_multi_head_attention(self):
        for h, g in ((4, 4), (4, 2), (4, 1)):   # MHA, GQA, MQA
            with self.subTest(h=h, g=g):
                r = rng(200 + h * 10 + g)
                T, dm = 9, 16
                d = dm // h
                x = r.standard_normal((T, dm), dtype=np.float32)
                wq = r.standard_normal((dm, h * d), dtype=np.float32) * 0.3
                wk = r.standard_normal((dm, g * d), dtype=np.float32) * 0.3
                wv = r.standard_normal((dm, g * d), dtype=np.float32) * 0.3
                wo = r.standard_normal((h * d, dm), dtype=np.float32) * 0.3
                out = pagedkv.multi_head_attention(x, wq, wk, wv, wo, h, g)
                ref = ref_mha(x, wq, wk, wv, wo, h, g)
                self.assertLessEqual(np.max(np.abs(out - ref)), 1e-5 * np.max(np.abs(ref)))
        r = rng(3)
        x = r.standard_normal((3, 16), dtype=np.float32)
        w = np.zeros((16, 16), dtype=np.float32)
        # MHA by default: n_kv_heads = n_heads
        self.assertEqual(pagedkv.multi_head_attention(x, w, w, w, w, 4).shape, (3, 16))
        with self.assertRaisesRegex(ValueError, "not a multiple of n_heads"):   # d_model % h
            pagedkv.multi_head_attention(x, w, w, w, w, 3)
        with self.assertRaisesRegex(ValueError, "not a multiple of n_kv_heads"):  # h % g
            pagedkv.multi_head_attention(x, w, w, w, w, 4, 3)

    def test_kv_cache_bytes(self):
        self.assertEqual(pagedkv.kv_cache_bytes(32, 8, 128, 8192, 1, 2), 2**30)
        self.assertEqual(pagedkv.kv_cache_bytes(32, 32, 128, 8192, 1, 2), 4 * 2**30)
        self.assertEqual(pagedkv.kv_cache_bytes(0, 8, 128, 8192, 1, 2), 0)
        with self.assertRaises(pagedkv.OutOfRange) as cm:
            pagedkv.kv_cache_bytes(2**40, 2**20, 128, 8192, 1, 2)
        self.assertIsInstance(cm.exception, ValueError)
        self.assertEqual(cm.exception.status, pagedkv.ERANGE)
        with self.assertRaises(ValueError):
            pagedkv.kv_cache_bytes(-1, 8, 128, 8192, 1, 2)


class Bitwise(unittest.TestCase):
    """The package passes arrays through unchanged: its results are bit for bit what the
    library returns when called from C with the same floats."""

    def test_against_raw_calls(self):
        h, g, d, T = 8, 4, 8, 21
        r = rng(4)
        q = r.standard_normal((T, h, d), dtype=np.float32)
        k = r.standard_normal((T, g, d), dtype=np.float32)
        v = r.standard_normal((T, g, d), dtype=np.float32)
        with pagedkv.Engine(n_layers=1, n_heads=h, n_kv_heads=g, head_dim=d,
                            kv_dtype="f16") as e:
            s = e.session()
            raw = e.session()
            out_c = np.empty((h, d), dtype=np.float32)
            for t in range(T):
                s.append(0, k[t], v[t])
                self.assertEqual(_lib.pkv_append(raw._handle(), 0, k[t].ctypes.data,
                                                 v[t].ctypes.data), 0)
                out_py = s.decode(0, q[t])
                self.assertEqual(_lib.pkv_decode(raw._handle(), 0, q[t].ctypes.data,
                                                 out_c.ctypes.data), 0)
                self.assertTrue(np.array_equal(out_py.view(np.uint32), out_c.view(np.uint32)))
        out_c = np.empty((T, h, d), dtype=np.float32)
        self.assertEqual(_lib.pkv_causal_attention(T, h, g, d, 0.0, q.ctypes.data,
                                                   k.ctypes.data, v.ctypes.data,
                                                   out_c.ctypes.data), 0)
        self.assertTrue(np.array_equal(pagedkv.causal_attention(q, k, v).view(np.uint32),
                                       out_c.view(np.uint32)))

    def test_input_forms_and_no_copy(self):
        h, g, d = 4, 2, 8
        r = rng(5)
        k = r.standard_normal((g, d), dtype=np.float32)
        v = r.standard_normal((g, d), dtype=np.float32)
        q = r.standard_normal((h, d), dtype=np.float32)
        forms = [lambda a: a, lambda a: a.tolist(), lambda a: a.astype(np.float64),
                 lambda a: np.asfortranarray(a), lambda a: a.reshape(-1),
                 lambda a: np.repeat(a, 2, axis=1)[:, ::2]]  # strided view
        results = []
        for form in forms:
            with pagedkv.Engine(n_layers=1, n_heads=h, n_kv_heads=g, head_dim=d) as e, \
                    e.session() as s:
                s.append(0, form(k), form(v))
                results.append(s.decode(0, form(q)))
        for res in results[1:]:
            self.assertTrue(np.array_equal(res, results[0]))
        with pagedkv.Engine(n_layers=1, n_heads=h, n_kv_heads=g, head_dim=d) as e, \
                e.session() as s:
            s.append(0, k, v)
            out = np.empty((h, d), dtype=np.float32)
            self.assertIs(s.decode(0, q, out=out), out)      # written in place
            self.assertTrue(np.array_equal(out, results[0]))
            with self.assertRaises(ValueError):
                s.decode(0, q, out=np.empty((h, d)))          # float64 out: refused
            with self.assertRaises(ValueError):
                s.append(0, np.zeros((g, d + 1)), v)          # wrong shape


if __name__ == "__main__":
    pkvtest.run()
