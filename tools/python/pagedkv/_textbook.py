"""The dense reference functions (docs/design.md): the textbook attention layer, causal
attention and the KV-cache size formula (the C library computes them, in double)."""
import ctypes

import numpy as np

from . import _args as A
from . import _lib as L


def _size(name, v):
    """A size the library takes as uint32_t and refuses when 0 (the caller's array
    shapes, so only their range needs checking)."""
    v = A.u32(v, name)
    if v == 0:
        raise ValueError(f"{name} is 0")
    return v


def kv_cache_bytes(layers, n_kv_heads, head_dim, seq_len, batch, bytes_per_value):
    """2 * layers * n_kv_heads * head_dim * seq_len * batch * bytes_per_value, exactly.
    Each factor an integer in 0..2**64-1; zero factors give 0; OutOfRange (a
    ValueError) when the product overflows uint64."""
    args = [A.u64(v, f"kv_cache_bytes {name}") for name, v in
            zip(("layers", "n_kv_heads", "head_dim", "seq_len", "batch", "bytes_per_value"),
                (layers, n_kv_heads, head_dim, seq_len, batch, bytes_per_value))]
    out = ctypes.c_uint64()
    st = L.pkv_kv_cache_bytes(*args, ctypes.byref(out))
    if st != L.OK:
        L.raise_for(st, "kv_cache_bytes", "the product overflows uint64"
                    if st == L.ERANGE else "")
    return out.value


def causal_attention(Q, K, V, scale=0.0):
    """Causal attention, the library's dense reference (accumulated in double, rounded
    once to float32), in either form:

      one head, as the textbook writes it: Q, K, V [T][d] -> [T][d];
      several heads:  Q [T][h][d], K, V [T][g][d] -> [T][h][d], query head i reading
                      KV group i // (h // g).

    scale 0 means 1/sqrt(d)."""
    arrays = [a if isinstance(a, np.ndarray) else np.asarray(a) for a in (Q, K, V)]
    dims = {a.ndim for a in arrays}
    if dims == {2}:
        q, k, v = (a[:, None, :] for a in arrays)           # a view: one head
        single = True
    elif dims == {3}:
        q, k, v = arrays
        single = False
    else:
        raise ValueError("causal_attention: Q, K, V must all be [T][d] (one head) or all "
                         f"[T][heads][d]; got shapes {arrays[0].shape}, {arrays[1].shape}, "
                         f"{arrays[2].shape}")
    T, h, d = q.shape
    g = k.shape[1]
    if k.shape != (T, g, d) or v.shape != k.shape:
        raise ValueError(f"causal_attention: K {arrays[1].shape} and V {arrays[2].shape} "
                         f"do not match Q {arrays[0].shape}")
    if g == 0 or h % g:
        raise ValueError(f"causal_attention: n_heads {h} is not a multiple of "
                         f"n_kv_heads {g}")
    T, h, g, d = (_size(n, x) for n, x in (("T", T), ("n_heads", h), ("n_kv_heads", g),
                                           ("head_dim", d)))
    q = A.float32(q, (T, h, d), "causal_attention Q")
    k = A.float32(k, (T, g, d), "causal_attention K")
    v = A.float32(v, (T, g, d), "causal_attention V")
    out = np.empty((T, h, d), dtype=np.float32)
    st = L.pkv_causal_attention(T, h, g, d, A.real(scale, "causal_attention scale"),
                                q.ctypes.data, k.ctypes.data, v.ctypes.data,
                                out.ctypes.data)
    if st != L.OK:
        L.raise_for(st, "causal_attention")
    return out.reshape(T, d) if single else out


def multi_head_attention(X, Wq, Wk, Wv, Wo, n_heads, n_kv_heads=None):
    """The textbook layer: X [T][d_model], Wq [d_model][h*d],
    Wk, Wv [d_model][g*d], Wo [h*d][d_model] with d = d_model / h; Q = X Wq, K = X Wk,
    V = X Wv, causal attention per head (GQA mapping), heads concatenated, times Wo.
    Returns [T][d_model]. n_kv_heads defaults to n_heads (MHA). ValueError when
    d_model % n_heads or n_heads % n_kv_heads is not 0."""
    x = X if isinstance(X, np.ndarray) else np.asarray(X)
    if x.ndim != 2:
        raise ValueError(f"multi_head_attention: X {x.shape} must be [T][d_model]")
    T, dm = x.shape
    h = A.u32(n_heads, "multi_head_attention n_heads")
    g = h if n_kv_heads is None else A.u32(n_kv_heads, "multi_head_attention n_kv_heads")
    if h <= 0 or g <= 0:
        raise ValueError(f"multi_head_attention: n_heads {h} and n_kv_heads {g} must be > 0")
    if dm % h:
        raise ValueError(f"multi_head_attention: d_model {dm} is not a multiple of "
                         f"n_heads {h}")
    if h % g:
        raise ValueError(f"multi_head_attention: n_heads {h} is not a multiple of "
                         f"n_kv_heads {g}")
    T, dm = _size("T", T), _size("d_model", dm)
    d = dm // h
    x = A.float32(x, (T, dm), "X")
    wq = A.float32(Wq, (dm, h * d), "Wq")
    wk = A.float32(Wk, (dm, g * d), "Wk")
    wv = A.float32(Wv, (dm, g * d), "Wv")
    wo = A.float32(Wo, (h * d, dm), "Wo")
    out = np.empty((T, dm), dtype=np.float32)
    st = L.pkv_mha_forward(T, dm, h, g, x.ctypes.data, wq.ctypes.data, wk.ctypes.data,
                           wv.ctypes.data, wo.ctypes.data, out.ctypes.data)
    if st != L.OK:
        L.raise_for(st, "multi_head_attention")
    return out
