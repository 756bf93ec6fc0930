"""Engine and Session: the paged KV cache and its decode attention (pagedkv.h)."""
import ctypes
import os
import weakref

import numpy as np

from . import _lib as L

DTYPES = {"f32": 0, "f16": 1, "bf16": 2, "q8": 3, "q4": 4}
_LAYER_FIELDS = ("window", "sink_tokens", "rollback_tokens", "softcap", "sink_logits")


def f32_array(x, shape, what):
    """x as a float32 C-contiguous array of `shape` (or flat of that size): the same
    object when it already is one (no copy), else a converted copy."""
    a = np.asarray(x, dtype=np.float32)
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    if a.shape != tuple(shape):
        n = 1
        for s in shape:
            n *= s
        if a.ndim != 1 or a.size != n:
            raise ValueError(f"{what}: shape {a.shape}, expected {tuple(shape)}")
    return a


def out_array(out, shape, what):
    """A float32 C-contiguous writable array of `shape` for results: `out` itself if
    given (written in place), else a new one."""
    if out is None:
        return np.empty(shape, dtype=np.float32)
    if (not isinstance(out, np.ndarray) or out.dtype != np.float32 or
            not out.flags.c_contiguous or not out.flags.writeable or
            out.size != int(np.prod(shape))):
        raise ValueError(f"{what}: out must be a writable C-contiguous float32 array of "
                         f"shape {tuple(shape)}")
    return out


def _dtype_code(t):
    if isinstance(t, str):
        try:
            return DTYPES[t.lower()]
        except KeyError:
            raise ValueError(f"kv_dtype {t!r}: one of {', '.join(DTYPES)}") from None
    return int(t)


def _layer_get(entry, name):
    if isinstance(entry, dict):
        unknown = set(entry) - set(_LAYER_FIELDS)
        if unknown:
            raise ValueError(f"layer_cfg: unknown field(s) {sorted(unknown)}; "
                             f"fields are {', '.join(_LAYER_FIELDS)}")
        return entry.get(name)
    return getattr(entry, name, None)


def _tokens_array(tokens):
    """Token ids as the int32 C-contiguous flat array the prefix calls read."""
    return np.ascontiguousarray(np.asarray(tokens, dtype=np.int32).reshape(-1))


class _Handle:
    """What Engine and Session share of a library handle's lifetime: `with` closes it,
    garbage collection closes it, `closed` tells, and _handle() refuses a closed one.
    A subclass sets _h (None when closed), _what (its name in the error) and close()."""

    _what = "handle"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone
            pass

    @property
    def closed(self):
        return self._h is None

    def _handle(self):
        if self._h is None:
            raise ValueError(f"the {self._what} is closed")
        return self._h


class Engine(_Handle):
    """One engine per model geometry: the page pool, kernels, threads, spill file.

    Keyword arguments are pkv_config's fields: n_layers, n_heads, n_kv_heads, head_dim
    (required), block_tokens, kv_dtype ("f32", "f16", "bf16", "q8", "q4" or its number),
    scale, mem_budget, spill_dir, n_threads, head_dim_v, layer_cfg (a list of n_layers
    dicts or objects with window, sink_tokens, rollback_tokens, softcap, sink_logits),
    quant_dot, prefix_cache_bytes. Unset fields keep pkv_config_default()'s values.
    """

    _what = "engine"

    def __init__(self, *, n_layers, n_heads, n_kv_heads, head_dim, block_tokens=0,
                 kv_dtype="f32", scale=0.0, mem_budget=0, spill_dir=None, n_threads=0,
                 head_dim_v=0, layer_cfg=None, quant_dot=0, prefix_cache_bytes=0):
        self._h = None
        self._sessions = weakref.WeakSet()
        c = L.pkv_config_default()
        for name, val in (("n_layers", n_layers), ("n_heads", n_heads),
                          ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                          ("block_tokens", block_tokens), ("n_threads", n_threads),
                          ("head_dim_v", head_dim_v), ("quant_dot", int(quant_dot))):
            if not 0 <= int(val) < 2**32:
                raise ValueError(f"{name} {val}: out of range of uint32")
            setattr(c, name, int(val))
        for name, val in (("mem_budget", mem_budget),
                          ("prefix_cache_bytes", prefix_cache_bytes)):
            if not 0 <= int(val) < 2**64:
                raise ValueError(f"{name} {val}: out of range of uint64")
            setattr(c, name, int(val))
        c.kv_dtype = _dtype_code(kv_dtype)
        c.scale = float(scale)
        if spill_dir is not None:
            c.spill_dir = os.fsencode(spill_dir)
        keep = []  # arrays the library reads during create (it copies them)
        if layer_cfg is not None:
            layer_cfg = list(layer_cfg)
            if len(layer_cfg) != c.n_layers:
                raise ValueError(f"layer_cfg: {len(layer_cfg)} entries for {c.n_layers} "
                                 "layers")
            arr = (L.LayerConfig * max(1, len(layer_cfg)))()
            for i, entry in enumerate(layer_cfg):
                for name in ("window", "sink_tokens", "rollback_tokens"):
                    setattr(arr[i], name, int(_layer_get(entry, name) or 0))
                arr[i].softcap = float(_layer_get(entry, "softcap") or 0.0)
                sl = _layer_get(entry, "sink_logits")
                if sl is not None:
                    sl = f32_array(sl, (c.n_heads,), f"layer_cfg[{i}].sink_logits")
                    keep.append(sl)
                    arr[i].sink_logits = sl.ctypes.data
            keep.append(arr)
            c.layer_cfg = ctypes.cast(arr, ctypes.POINTER(L.LayerConfig))
        h = ctypes.c_void_p()
        status = L.pkv_engine_create(ctypes.byref(c), ctypes.byref(h))
        if status != L.OK:
            why = ctypes.create_string_buffer(256)
            L.pkv_config_explain(ctypes.byref(c), why, len(why))
            L.raise_for(status, "Engine", why.value.decode(errors="replace"))
        self._h = h
        rc = L.Config()
        L.pkv_engine_config(h, ctypes.byref(rc))
        self.n_layers, self.n_heads = rc.n_layers, rc.n_heads
        self.n_kv_heads, self.head_dim = rc.n_kv_heads, rc.head_dim
        self.head_dim_v = rc.head_dim_v or rc.head_dim
        self.block_tokens, self.scale, self.n_threads = rc.block_tokens, rc.scale, rc.n_threads
        self.kv_dtype = L.pkv_dtype_name(rc.kv_dtype).decode()

    # -- lifetime ---------------------------------------------------------------------
    def close(self):
        """Destroy the engine; its sessions are closed first. Idempotent."""
        if self._h is None:
            return
        for s in list(self._sessions):
            s.close()
        L.pkv_engine_destroy(self._h)
        self._h = None

    def last_error(self):
        """The reason of the most recent failed call on this engine or its sessions."""
        buf = ctypes.create_string_buffer(256)
        L.pkv_engine_last_error(self._handle(), buf, len(buf))
        return buf.value.decode(errors="replace")

    def _check(self, status, what):
        if status != L.OK:
            L.raise_for(status, what, self.last_error())

    # -- sessions ---------------------------------------------------------------------
    def session(self):
        """A new, empty Session."""
        h = ctypes.c_void_p()
        self._check(L.pkv_session_create(self._handle(), ctypes.byref(h)), "session")
        return Session(self, h)

    def load(self, path):
        """A Session read from a session file (pkv_session_load)."""
        h = ctypes.c_void_p()
        self._check(L.pkv_session_load(self._handle(), os.fsencode(path), ctypes.byref(h)),
                    f"load {os.fsdecode(path)!r}")
        return Session(self, h)

    if L.HAVE_PREFIX:
        def from_prefix(self, tokens):
            """(session, n_cached): a session sharing the longest cached prefix of the
            token ids (SPEC §10)."""
            t = _tokens_array(tokens)
            h, n = ctypes.c_void_p(), ctypes.c_uint64()
            self._check(L.pkv_session_from_prefix(self._handle(), t.size, t.ctypes.data,
                                                  ctypes.byref(h), ctypes.byref(n)),
                        "from_prefix")
            return Session(self, h), n.value

    def decode_batch(self, layer, sessions, q, out=None):
        """One query per session: q [n][n_heads][head_dim] -> [n][n_heads][head_dim_v]."""
        sessions = list(sessions)
        n = len(sessions)
        for s in sessions:
            if not isinstance(s, Session) or s._engine is not self:
                raise ValueError("decode_batch: every session must be a Session of this "
                                 "engine")
        hs = (ctypes.c_void_p * max(1, n))(*[s._handle() for s in sessions])
        qa = f32_array(q, (n, self.n_heads, self.head_dim), "decode_batch q")
        o = out_array(out, (n, self.n_heads, self.head_dim_v), "decode_batch")
        self._check(L.pkv_decode_batch(self._handle(), layer, n, hs, qa.ctypes.data,
                                       o.ctypes.data), "decode_batch")
        return o

    # -- figures ----------------------------------------------------------------------
    def stats(self):
        """pkv_engine_stats as a dict (isa, io_backend, pool and the page counters)."""
        s = L.Stats()
        self._check(L.pkv_engine_stats(self._handle(), ctypes.byref(s)), "stats")
        d = {}
        for name, _ in L.Stats._fields_:
            v = getattr(s, name)
            d[name] = v.decode() if isinstance(v, bytes) else v
        return d

    def check(self):
        """pkv_engine_check: raises pagedkv.CorruptFile if an invariant is broken (a library
        defect)."""
        self._check(L.pkv_engine_check(self._handle()), "check")

    def __repr__(self):
        if self._h is None:
            return "<pagedkv.Engine closed>"
        return (f"<pagedkv.Engine layers={self.n_layers} heads={self.n_heads}/"
                f"{self.n_kv_heads} head_dim={self.head_dim} {self.kv_dtype}>")


class Session(_Handle):
    """One sequence: every layer's cached K/V. Made by Engine.session(), Engine.load(),
    Session.fork(). Holds its engine alive; close() (or garbage collection) releases
    its pages."""

    _what = "session"

    def __init__(self, engine, handle):
        self._engine = engine
        self._h = handle
        engine._sessions.add(self)

    def close(self):
        if self._h is None:
            return
        L.pkv_session_destroy(self._h)
        self._h = None

    @property
    def engine(self):
        return self._engine

    def _check(self, status, what):
        if status != L.OK:
            self._engine._check(status, what)

    def append(self, layer, k, v):
        """Append one token's k [n_kv_heads][head_dim] and v [n_kv_heads][head_dim_v]."""
        e = self._engine
        ka = f32_array(k, (e.n_kv_heads, e.head_dim), "append k")
        va = f32_array(v, (e.n_kv_heads, e.head_dim_v), "append v")
        self._check(L.pkv_append(self._handle(), layer, ka.ctypes.data, va.ctypes.data),
                    "append")

    def decode(self, layer, q, out=None):
        """Attention of q [n_heads][head_dim] over the layer's cache -> [n_heads][head_dim_v]."""
        e = self._engine
        qa = f32_array(q, (e.n_heads, e.head_dim), "decode q")
        o = out_array(out, (e.n_heads, e.head_dim_v), "decode")
        self._check(L.pkv_decode(self._handle(), layer, qa.ctypes.data, o.ctypes.data),
                    "decode")
        return o

    def prefill(self, layer, q, k, v, out=None):
        """Append n tokens (k, v [n][n_kv_heads][...]) and return each one's causal
        attention output for q [n][n_heads][head_dim] -> [n][n_heads][head_dim_v]."""
        e = self._engine
        qa = np.asarray(q, dtype=np.float32)
        n = qa.shape[0] if qa.ndim == 3 else qa.size // (e.n_heads * e.head_dim)
        qa = f32_array(qa, (n, e.n_heads, e.head_dim), "prefill q")
        ka = f32_array(k, (n, e.n_kv_heads, e.head_dim), "prefill k")
        va = f32_array(v, (n, e.n_kv_heads, e.head_dim_v), "prefill v")
        o = out_array(out, (n, e.n_heads, e.head_dim_v), "prefill")
        self._check(L.pkv_prefill(self._handle(), layer, n, qa.ctypes.data, ka.ctypes.data,
                                  va.ctypes.data, o.ctypes.data), "prefill")
        return o

    def fork(self):
        """A new Session sharing every page of this one (copy-on-write)."""
        h = ctypes.c_void_p()
        self._check(L.pkv_session_fork(self._handle(), ctypes.byref(h)), "fork")
        return Session(self._engine, h)

    def truncate(self, n_tokens):
        """Every layer keeps min(its length, n_tokens)."""
        if n_tokens < 0:
            raise ValueError(f"truncate: n_tokens {n_tokens} is negative")
        self._check(L.pkv_session_truncate(self._handle(), n_tokens), "truncate")

    def len(self, layer=0):
        """Cached positions of `layer`."""
        return L.pkv_session_len(self._handle(), layer)

    def __len__(self):
        return self.len(0)

    def memory(self):
        """pkv_session_memory as a dict of byte and page counts."""
        m = L.Memory()
        self._check(L.pkv_session_memory(self._handle(), ctypes.byref(m)), "memory")
        return {name: getattr(m, name) for name, _ in L.Memory._fields_}

    @staticmethod
    def load(engine, path):
        """A Session of `engine` read from a session file (the same as engine.load)."""
        return engine.load(path)

    def save(self, path):
        """Write the session to `path` atomically (mode 0600)."""
        self._check(L.pkv_session_save(self._handle(), os.fsencode(path)),
                    f"save {os.fsdecode(path)!r}")

    if L.HAVE_PREFIX:
        def set_tokens(self, tokens):
            """Record the token ids of positions [0, len(tokens)) for prefix reuse."""
            t = _tokens_array(tokens)
            self._check(L.pkv_session_set_tokens(self._handle(), t.size, t.ctypes.data),
                        "set_tokens")

    def __repr__(self):
        if self._h is None:
            return "<pagedkv.Session closed>"
        return f"<pagedkv.Session len={self.len(0)}>"
