"""The dense reference functions of SPEC §1: the textbook attention layer, causal
attention and the KV-cache size formula (the C library computes them, in double)."""
import ctypes

import numpy as np

from . import _lib as L
from ._engine import f32_array


def _u32(name, v):
    v = int(v)
    if not 0 < v < 2**32:
        raise ValueError(f"{name} {v}: must be between 1 and 2^32 - 1")
    return v


def kv_cache_bytes(layers, n_kv_heads, head_dim, seq_len, batch, bytes_per_value):
    """2 * layers * n_kv_heads * head_dim * seq_len * batch * bytes_per_value, exactly.
    Zero factors give 0; OutOfRange (a ValueError) when it overflows uint64."""
    args = (layers, n_kv_heads, head_dim, seq_len, batch, bytes_per_value)
    for name, v in zip(("layers", "n_kv_heads", "head_dim", "seq_len", "batch",
                        "bytes_per_value"), args):
        if int(v) != v or not 0 <= v < 2**64:
            raise ValueError(f"kv_cache_bytes: {name} {v!r} is not a uint64")
    out = ctypes.c_uint64()
    st = L.pkv_kv_cache_bytes(*[int(v) for v in args], ctypes.byref(out))
    if st != L.OK:
        L.raise_for(st, "kv_cache_bytes", "the product overflows uint64"
                    if st == L.ERANGE else "")
    return out.value


def causal_attention(Q, K, V, scale=0.0):
    """Causal attention of Q [T][h][d] over K, V [T][g][d] -> [T][h][d] (float32; the
    library's dense reference, accumulated in double). Query head i reads KV group
    i // (h // g); scale 0 means 1/sqrt(d)."""
    q = np.asarray(Q, dtype=np.float32)
    k = np.asarray(K, dtype=np.float32)
    if q.ndim != 3 or k.ndim != 3:
        raise ValueError(f"causal_attention: Q {q.shape} and K {k.shape} must be "
                         "[T][heads][head_dim]")
    T, h, d = q.shape
    g = k.shape[1]
    if k.shape != (T, g, d):
        raise ValueError(f"causal_attention: K {k.shape} does not match Q {q.shape}")
    if g == 0 or h % g:
        raise ValueError(f"causal_attention: n_heads {h} is not a multiple of "
                         f"n_kv_heads {g}")
    q = f32_array(q, (T, h, d), "causal_attention Q")
    k = f32_array(k, (T, g, d), "causal_attention K")
    v = f32_array(V, (T, g, d), "causal_attention V")
    out = np.empty((T, h, d), dtype=np.float32)
    st = L.pkv_causal_attention(_u32("T", T), _u32("n_heads", h), _u32("n_kv_heads", g),
                                _u32("head_dim", d), float(scale), q.ctypes.data,
                                k.ctypes.data, v.ctypes.data, out.ctypes.data)
    if st != L.OK:
        L.raise_for(st, "causal_attention")
    return out


def multi_head_attention(X, Wq, Wk, Wv, Wo, n_heads, n_kv_heads=None):
    """The textbook layer (SPEC §1): X [T][d_model], Wq [d_model][h*d],
    Wk, Wv [d_model][g*d], Wo [h*d][d_model] with d = d_model / h; Q = X Wq, K = X Wk,
    V = X Wv, causal attention per head (GQA mapping), heads concatenated, times Wo.
    Returns [T][d_model]. n_kv_heads defaults to n_heads (MHA). ValueError when
    d_model % n_heads or n_heads % n_kv_heads is not 0."""
    x = np.asarray(X, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"multi_head_attention: X {x.shape} must be [T][d_model]")
    T, dm = x.shape
    h = int(n_heads)
    g = h if n_kv_heads is None else int(n_kv_heads)
    if h <= 0 or g <= 0:
        raise ValueError(f"multi_head_attention: n_heads {h} and n_kv_heads {g} must be > 0")
    if dm % h:
        raise ValueError(f"multi_head_attention: d_model {dm} is not a multiple of "
                         f"n_heads {h}")
    if h % g:
        raise ValueError(f"multi_head_attention: n_heads {h} is not a multiple of "
                         f"n_kv_heads {g}")
    d = dm // h
    x = f32_array(x, (T, dm), "X")
    wq = f32_array(Wq, (dm, h * d), "Wq")
    wk = f32_array(Wk, (dm, g * d), "Wk")
    wv = f32_array(Wv, (dm, g * d), "Wv")
    wo = f32_array(Wo, (h * d, dm), "Wo")
    out = np.empty((T, dm), dtype=np.float32)
    st = L.pkv_mha_forward(_u32("T", T), _u32("d_model", dm), h, g, x.ctypes.data,
                           wq.ctypes.data, wk.ctypes.data, wv.ctypes.data, wo.ctypes.data,
                           out.ctypes.data)
    if st != L.OK:
        L.raise_for(st, "multi_head_attention")
    return out
