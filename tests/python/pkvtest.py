"""Shared helpers of the Python tests: the SKIP rule, fixed seeds, numpy references."""
import os
import sys

try:
    import numpy as np
except ImportError:
    print("SKIP: numpy is not installed for", sys.executable)
    sys.exit(77)

SEED = int(os.environ.get("PKV_TEST_SEED", "20261201"))
QUICK = os.environ.get("PKV_TEST_QUICK") == "1"


def rng(salt=0):
    return np.random.default_rng(SEED + salt)


def ref_attention(q, k, v, scale=None, window=0, sink_tokens=0):
    """Causal attention in float64: q [T][h][d], k [T][g][d], v [T][g][dv] -> [T][h][dv].
    Query head i reads group i // (h // g)."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    T, h, d = q.shape
    g, dv = k.shape[1], v.shape[2]
    if scale is None or scale == 0:
        scale = 1.0 / np.sqrt(d)
    out = np.zeros((T, h, dv))
    for t in range(T):
        j = np.arange(t + 1)
        if window:
            keep = (j > t - window) | (j < sink_tokens)
            j = j[keep]
        for i in range(h):
            grp = i // (h // g)
            s = scale * (k[j, grp] @ q[t, i])
            w = np.exp(s - s.max())
            out[t, i] = (w / w.sum()) @ v[j, grp]
    return out


def ref_mha(x, wq, wk, wv, wo, h, g):
    """The textbook layer in float64."""
    x, wq, wk, wv, wo = (np.asarray(a, dtype=np.float64) for a in (x, wq, wk, wv, wo))
    T, dm = x.shape
    d = dm // h
    q = (x @ wq).reshape(T, h, d)
    k = (x @ wk).reshape(T, g, d)
    v = (x @ wv).reshape(T, g, d)
    return ref_attention(q, k, v).reshape(T, h * d) @ wo


def run(module_name="__main__"):
    import unittest
    prog = unittest.main(module=module_name, exit=False, verbosity=2)
    sys.exit(0 if prog.result.wasSuccessful() else 1)
