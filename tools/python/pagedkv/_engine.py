"""Engine and Session: the paged KV cache and its decode attention (pagedkv.h)."""
import ctypes
import os

import numpy as np

from . import _args as A
from . import _errors
from . import _lib as L

DTYPES = {"f32": 0, "f16": 1, "bf16": 2, "q8": 3, "q4": 4}
_LAYER_FIELDS = ("window", "sink_tokens", "rollback_tokens", "softcap", "sink_logits",
                 "rope", "rope_dims", "rope_theta", "rope_freq_scale")
# pkv_layer_config.rope by name: the engine rotates the keys it stores (docs/rope.md)
ROPE = {None: 0, "none": 0, "norm": L.ROPE_NORM, "neox": L.ROPE_NEOX}


def _rope_code(v, i):
    if isinstance(v, str) or v is None:
        if v not in ROPE:
            raise ValueError(f"layer_cfg[{i}].rope: {v!r} is not one of "
                             "'none', 'norm', 'neox' (or 0, 1, 2)")
        return ROPE[v]
    return A.u32(v, f"layer_cfg[{i}].rope")


class _Owner:
    """The one owner of an engine's C handle and of its sessions' C handles: the only
    code that destroys them. Engine and Session objects hold it strongly; it holds no
    Python object but ints, so nothing a garbage collection does to Engine and Session
    objects can empty it. (The collector clears the weak references to a garbage
    cycle first, then runs every finalizer of the cycle in no fixed order, then
    clears the objects: a WeakSet of sessions is empty by the time an Engine's
    __del__ reads it, and a Session's __del__ may run after the Engine's.)

    Invariants:  engine is None  =>  sessions is empty;
                 a session handle is destroyed at most once, by drop() or close(),
                 and never after the engine (close() destroys the remaining ones
                 first, as pkv_engine_destroy requires).
    So every Session.close() and Engine.close(), in any order, any number of times,
    from any finalizer, touches only live C objects. The C functions are kept here
    (class attributes) because the module's globals may already be gone when a
    finalizer runs at interpreter exit."""

    __slots__ = ("engine", "sessions")
    _session_destroy = staticmethod(L.pkv_session_destroy)
    _engine_destroy = staticmethod(L.pkv_engine_destroy)

    def __init__(self, engine):
        self.engine = engine        # int (the pkv_engine *), None once destroyed
        self.sessions = set()       # ints: the live pkv_session * of this engine

    def adopt(self, handle):
        """Take ownership of a new session's handle (an int)."""
        self.sessions.add(handle)
        return handle

    def owns(self, handle):
        return handle in self.sessions

    def drop(self, handle):
        """Destroy one session's handle, if it is still live (else nothing)."""
        try:
            self.sessions.remove(handle)
        except KeyError:
            return
        self._session_destroy(handle)

    def close(self):
        """Destroy every live session, then the engine. Idempotent."""
        while self.sessions:
            self._session_destroy(self.sessions.pop())
        engine, self.engine = self.engine, None
        if engine is not None:
            self._engine_destroy(engine)

    def __del__(self):
        self.close()


def _dtype_code(t):
    if isinstance(t, str):
        try:
            return DTYPES[t.lower()]
        except KeyError:
            raise ValueError(f"kv_dtype {t!r}: one of {', '.join(DTYPES)}") from None
    return A.i32(t, "kv_dtype")


def _layer_get(entry, name, i):
    if isinstance(entry, dict):
        unknown = set(entry) - set(_LAYER_FIELDS)
        if unknown:
            raise ValueError(f"layer_cfg: unknown field(s) {sorted(unknown)}; "
                             f"fields are {', '.join(_LAYER_FIELDS)}")
        return entry.get(name)
    if isinstance(entry, (str, bytes)) or not any(hasattr(entry, f) for f in _LAYER_FIELDS):
        raise TypeError(f"layer_cfg[{i}]: expected a dict or an object with attributes "
                        f"{', '.join(_LAYER_FIELDS)}, got {type(entry).__name__}")
    return getattr(entry, name, None)


class Engine:
    """One engine per model geometry: the page pool, kernels, threads, spill file.

    Keyword arguments are pkv_config's fields: n_layers, n_heads, n_kv_heads, head_dim
    (required), block_tokens, kv_dtype ("f32", "f16", "bf16", "q8", "q4" or its number),
    scale, mem_budget, spill_dir, n_threads, head_dim_v, layer_cfg (a list of n_layers
    dicts or objects with window, sink_tokens, rollback_tokens, softcap, sink_logits,
    and the engine's RoPE: rope ("norm", "neox" or 0/1/2), rope_dims, rope_theta,
    rope_freq_scale), quant_dot, prefix_cache_bytes. Unset fields keep pkv_config_default()'s values.
    Integers must be ints (or numpy integers) that fit their C field; see _args.py.
    """

    _owner = None

    def __init__(self, *, n_layers, n_heads, n_kv_heads, head_dim, block_tokens=0,
                 kv_dtype="f32", scale=0.0, mem_budget=0, spill_dir=None, n_threads=0,
                 head_dim_v=0, layer_cfg=None, quant_dot=0, prefix_cache_bytes=0):
        c = L.pkv_config_default()
        for name, val in (("n_layers", n_layers), ("n_heads", n_heads),
                          ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                          ("block_tokens", block_tokens), ("n_threads", n_threads),
                          ("head_dim_v", head_dim_v)):
            setattr(c, name, A.u32(val, name))
        c.quant_dot = A.flag(quant_dot, "quant_dot")
        c.mem_budget = A.u64(mem_budget, "mem_budget")
        c.prefix_cache_bytes = A.u64(prefix_cache_bytes, "prefix_cache_bytes")
        c.kv_dtype = _dtype_code(kv_dtype)
        c.scale = A.real(scale, "scale")
        if spill_dir is not None:
            c.spill_dir = A.path(spill_dir, "spill_dir")
        keep = []  # arrays the library reads during create (it copies them)
        if layer_cfg is not None:
            if isinstance(layer_cfg, (dict, str, bytes)):
                raise TypeError("layer_cfg: expected a list of one entry per layer, got "
                                f"{type(layer_cfg).__name__}")
            layer_cfg = list(layer_cfg)
            if len(layer_cfg) != c.n_layers:
                raise ValueError(f"layer_cfg: {len(layer_cfg)} entries for {c.n_layers} "
                                 "layers")
            arr = (L.LayerConfig * max(1, len(layer_cfg)))()
            for i, entry in enumerate(layer_cfg):
                for name in ("window", "sink_tokens", "rollback_tokens"):
                    v = _layer_get(entry, name, i)
                    setattr(arr[i], name, 0 if v is None else
                            A.u32(v, f"layer_cfg[{i}].{name}"))
                v = _layer_get(entry, "softcap", i)
                arr[i].softcap = 0.0 if v is None else A.real(v, f"layer_cfg[{i}].softcap")
                arr[i].rope = _rope_code(_layer_get(entry, "rope", i), i)
                v = _layer_get(entry, "rope_dims", i)
                arr[i].rope_dims = 0 if v is None else A.u32(v, f"layer_cfg[{i}].rope_dims")
                for name in ("rope_theta", "rope_freq_scale"):
                    v = _layer_get(entry, name, i)
                    setattr(arr[i], name, 0.0 if v is None else
                            A.real(v, f"layer_cfg[{i}].{name}"))
                sl = _layer_get(entry, "sink_logits", i)
                if sl is not None:
                    sl = A.float32(sl, (c.n_heads,), f"layer_cfg[{i}].sink_logits")
                    keep.append(sl)
                    arr[i].sink_logits = sl.ctypes.data
            keep.append(arr)
            c.layer_cfg = ctypes.cast(arr, ctypes.POINTER(L.LayerConfig))
        h = ctypes.c_void_p()
        status = L.pkv_engine_create(ctypes.byref(c), ctypes.byref(h))
        if status != L.OK:
            why = ctypes.create_string_buffer(256)
            L.pkv_config_explain(ctypes.byref(c), why, len(why))
            errno = None
            if status in (L.EIO, L.EINVAL) and spill_dir is not None:
                errno = _errors.os_reason(c.spill_dir, "d")
            L.raise_for(status, "Engine", why.value.decode(errors="replace"), errno,
                        None if errno is None else os.fsdecode(c.spill_dir))
        self._owner = _Owner(h.value)
        rc = L.Config()
        L.pkv_engine_config(h, ctypes.byref(rc))
        self.n_layers, self.n_heads = rc.n_layers, rc.n_heads
        self.n_kv_heads, self.head_dim = rc.n_kv_heads, rc.head_dim
        self.head_dim_v = rc.head_dim_v or rc.head_dim
        self.block_tokens, self.scale, self.n_threads = rc.block_tokens, rc.scale, rc.n_threads
        self.kv_dtype = L.pkv_dtype_name(rc.kv_dtype).decode()

    # -- lifetime ---------------------------------------------------------------------
    def close(self):
        """Destroy the engine; its open sessions are closed first. Idempotent."""
        if self._owner is not None:
            self._owner.close()

    @property
    def closed(self):
        return self._owner is None or self._owner.engine is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # Only reached when no Session refers to this engine (each holds it) or all of
        # them are garbage with it; _Owner.close() is safe in either case.
        self.close()

    def _handle(self):
        if self.closed:
            raise ValueError("the engine is closed")
        return self._owner.engine

    def last_error(self):
        """The reason of the most recent failed call on this engine or its sessions."""
        buf = ctypes.create_string_buffer(256)
        L.pkv_engine_last_error(self._handle(), buf, len(buf))
        return buf.value.decode(errors="replace")

    def _check(self, status, what, path=None, mode=None):
        if status != L.OK:
            errno = None
            if status in (L.EIO, L.EINVAL) and path is not None:
                errno = _errors.os_reason(path, mode)
            L.raise_for(status, what, self.last_error(), errno,
                        None if errno is None else os.fsdecode(path))

    # -- sessions ---------------------------------------------------------------------
    def _session(self, call, what, path=None, mode=None):
        """A Session of the handle `call(out)` makes, owned from the moment it exists."""
        h = ctypes.c_void_p()
        self._check(call(ctypes.byref(h)), what, path, mode)
        return Session(self, self._owner.adopt(h.value))

    def session(self):
        """A new, empty Session."""
        e = self._handle()
        return self._session(lambda out: L.pkv_session_create(e, out), "session")

    def load(self, path):
        """A Session read from a session file (pkv_session_load)."""
        e = self._handle()
        p = A.path(path, "load")
        return self._session(lambda out: L.pkv_session_load(e, p, out),
                             f"load {os.fsdecode(p)!r}", p, "r")

    if L.HAVE_PREFIX:
        def from_prefix(self, tokens):
            """(session, n_cached): a session sharing the longest cached prefix of the
            token ids (docs/prefix-cache.md): a sequence of ints in int32's range."""
            e = self._handle()
            t = A.token_ids(tokens, "from_prefix tokens")
            n = ctypes.c_uint64()
            s = self._session(lambda out: L.pkv_session_from_prefix(
                e, t.size, t.ctypes.data, out, ctypes.byref(n)), "from_prefix")
            return s, n.value

    def decode_batch(self, layer, sessions, q, out=None):
        """One query per session: q [n][n_heads][head_dim] -> [n][n_heads][head_dim_v]."""
        e = self._handle()
        layer = A.u32(layer, "decode_batch layer")
        if isinstance(sessions, Session):
            raise TypeError("decode_batch: sessions must be a sequence of Sessions")
        sessions = list(sessions)
        n = A.u32(len(sessions), "decode_batch: the number of sessions")
        for s in sessions:
            if not isinstance(s, Session) or s._engine is not self:
                raise ValueError("decode_batch: every session must be a Session of this "
                                 "engine")
        hs = (ctypes.c_void_p * max(1, n))(*[s._handle() for s in sessions])
        qa = A.float32(q, (n, self.n_heads, self.head_dim), "decode_batch q")
        o = A.out_array(out, (n, self.n_heads, self.head_dim_v), "decode_batch", qa)
        self._check(L.pkv_decode_batch(e, layer, n, hs, qa.ctypes.data,
                                       o.ctypes.data), "decode_batch")
        return o

    # -- figures ----------------------------------------------------------------------
    def rope_q(self, layer, q, pos):
        """q [n][n_heads][head_dim] rotated at positions pos [n] (ints >= 0), as the
        engine rotates the keys it stores for `layer` (pkv_rope_q): a new float32 array;
        unchanged for a layer without rope."""
        e = self._handle()
        layer = A.u32(layer, "rope_q layer")
        p = np.asarray(pos).reshape(-1)
        if p.dtype.kind not in "iu":
            raise TypeError("rope_q pos: integers expected")
        if p.size and p.min() < 0:
            raise ValueError("rope_q pos: positions are >= 0")
        p = np.ascontiguousarray(p, dtype=np.uint64)
        n = A.u32(p.size, "rope_q: the number of rows")
        qa = A.float32(q, (n, self.n_heads, self.head_dim), "rope_q q")
        qa = np.array(qa, dtype=np.float32, copy=True).reshape(n, self.n_heads, self.head_dim)
        self._check(L.pkv_rope_q(e, layer, n, p.ctypes.data, qa.ctypes.data), "rope_q")
        return qa

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
        if self.closed:
            return "<pagedkv.Engine closed>"
        return (f"<pagedkv.Engine layers={self.n_layers} heads={self.n_heads}/"
                f"{self.n_kv_heads} head_dim={self.head_dim} {self.kv_dtype}>")


class Session:
    """One sequence: every layer's cached K/V. Made by Engine.session(), Engine.load(),
    Session.fork(), Engine.from_prefix(). Holds its engine alive; close() (or garbage
    collection) releases its pages."""

    _h = None

    def __init__(self, engine, handle):
        self._engine = engine
        self._owner = engine._owner
        self._h = handle

    def close(self):
        """Release the session's pages. Idempotent."""
        h, self._h = self._h, None
        if h is not None:
            self._owner.drop(h)

    @property
    def closed(self):
        return self._h is None or not self._owner.owns(self._h)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    def _handle(self):
        if self.closed:
            raise ValueError("the session is closed" if self._h is None else
                             "the session is closed (its engine was closed)")
        return self._h

    @property
    def engine(self):
        return self._engine

    def _check(self, status, what, path=None, mode=None):
        if status != L.OK:
            self._engine._check(status, what, path, mode)

    def _layer(self, layer, what):
        return A.u32(layer, f"{what} layer")

    def append(self, layer, k, v):
        """Append one token's k [n_kv_heads][head_dim] and v [n_kv_heads][head_dim_v]."""
        h, e = self._handle(), self._engine
        layer = self._layer(layer, "append")
        ka = A.float32(k, (e.n_kv_heads, e.head_dim), "append k")
        va = A.float32(v, (e.n_kv_heads, e.head_dim_v), "append v")
        self._check(L.pkv_append(h, layer, ka.ctypes.data, va.ctypes.data),
                    "append")

    def decode(self, layer, q, out=None):
        """Attention of q [n_heads][head_dim] over the layer's cache -> [n_heads][head_dim_v]."""
        h, e = self._handle(), self._engine
        layer = self._layer(layer, "decode")
        qa = A.float32(q, (e.n_heads, e.head_dim), "decode q")
        o = A.out_array(out, (e.n_heads, e.head_dim_v), "decode", qa)
        self._check(L.pkv_decode(h, layer, qa.ctypes.data, o.ctypes.data),
                    "decode")
        return o

    def prefill(self, layer, q, k, v, out=None):
        """Append n tokens (k, v [n][n_kv_heads][...]) and return each one's causal
        attention output for q [n][n_heads][head_dim] -> [n][n_heads][head_dim_v]."""
        h, e = self._handle(), self._engine
        layer = self._layer(layer, "prefill")
        qa = q if isinstance(q, np.ndarray) else np.asarray(q)
        n = qa.shape[0] if qa.ndim == 3 else qa.size // (e.n_heads * e.head_dim)
        n = A.u32(n, "prefill: the number of tokens")
        qa = A.float32(qa, (n, e.n_heads, e.head_dim), "prefill q")
        ka = A.float32(k, (n, e.n_kv_heads, e.head_dim), "prefill k")
        va = A.float32(v, (n, e.n_kv_heads, e.head_dim_v), "prefill v")
        o = A.out_array(out, (n, e.n_heads, e.head_dim_v), "prefill", qa, ka, va)
        self._check(L.pkv_prefill(h, layer, n, qa.ctypes.data, ka.ctypes.data,
                                  va.ctypes.data, o.ctypes.data), "prefill")
        return o

    def discard(self, p0, p1):
        """Drop positions [p0, p1) of every layer; later ones move down and their
        keys are re-rotated (pkv_session_discard; the layers need the engine's RoPE).
        p0 == p1 does nothing. A failed call changes nothing and raises:
        InvalidArgument (p0 > p1, or a layer holding positions >= p1 has no RoPE),
        OutOfRange (p1 past every layer's length; a cut into a window's released
        rows or its sinks; a shard's first position above p0), StateError (drafts
        pending), OutOfMemory, IOFailure (spilled pages not read back)."""
        h = self._handle()
        self._check(L.pkv_session_discard(h, A.u64(p0, "discard p0"), A.u64(p1, "discard p1")),
                    "discard")

    def verify(self, layer, parent, q, k, v, out=None):
        """Attention of n draft tokens of `layer` as a tree (docs/speculative.md):
        parent[i] < i is draft i's parent, or -1 for a child of the last cached position;
        q [n][n_heads][head_dim], k [n][n_kv_heads][head_dim], v [n][n_kv_heads]
        [head_dim_v] -> [n][n_heads][head_dim_v]. The drafts stay pending (len does not
        move) until commit(); a second verify of the layer replaces them."""
        h, e = self._handle(), self._engine
        layer = self._layer(layer, "verify")
        pa = A.token_ids(parent, "verify parent")
        n = A.u32(pa.size, "verify: the number of drafts")
        qa = A.float32(q, (n, e.n_heads, e.head_dim), "verify q")
        ka = A.float32(k, (n, e.n_kv_heads, e.head_dim), "verify k")
        va = A.float32(v, (n, e.n_kv_heads, e.head_dim_v), "verify v")
        o = A.out_array(out, (n, e.n_heads, e.head_dim_v), "verify", qa, ka, va)
        self._check(L.pkv_verify(h, layer, n, pa.ctypes.data if n else None,
                                 qa.ctypes.data, ka.ctypes.data, va.ctypes.data,
                                 o.ctypes.data), "verify")
        return o

    def commit(self, path=()):
        """Keep the pending drafts path (a root-to-node path of the verified tree: path[0]
        has parent -1, path[j + 1]'s parent is path[j]) on every verified layer: they
        become the next len(path) positions; every other draft is released. An empty path
        drops them all."""
        h = self._handle()
        if isinstance(path, (str, bytes, bytearray)):
            raise TypeError("commit: path must be a sequence of draft indices")
        pa = np.asarray(path)
        if pa.ndim != 1:
            raise ValueError(f"commit: path must be 1-D, got shape {pa.shape}")
        if pa.size and pa.dtype.kind not in "iu":
            raise TypeError(f"commit: draft indices must be integers, got dtype {pa.dtype}")
        idx = [A.u32(int(i), f"commit path[{j}]") for j, i in enumerate(pa)]
        arr = np.ascontiguousarray(idx, dtype=np.uint32)
        n = A.u32(arr.size, "commit: the path's length")
        self._check(L.pkv_session_commit(h, n, arr.ctypes.data if n else None), "commit")

    def fork(self):
        """A new Session sharing every page of this one (copy-on-write)."""
        src = self._handle()
        return self._engine._session(lambda out: L.pkv_session_fork(src, out), "fork")

    def truncate(self, n_tokens):
        """Every layer keeps min(its length, n_tokens)."""
        h = self._handle()
        n = A.u64(n_tokens, "truncate n_tokens")
        self._check(L.pkv_session_truncate(h, n), "truncate")

    def len(self, layer=0):
        """Cached positions of `layer` (InvalidArgument for a layer the engine lacks)."""
        h = self._handle()
        layer = self._layer(layer, "len")
        if layer >= self._engine.n_layers:
            raise L.InvalidArgument(f"len: layer {layer} of an engine with "
                                    f"{self._engine.n_layers} layers", L.EINVAL)
        return L.pkv_session_len(h, layer)

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
        if not isinstance(engine, Engine):
            raise TypeError(f"Session.load: expected an Engine, got {type(engine).__name__}")
        return engine.load(path)

    def save(self, path):
        """Write the session to `path` atomically (mode 0600)."""
        h = self._handle()
        p = A.path(path, "save")
        self._check(L.pkv_session_save(h, p), f"save {os.fsdecode(p)!r}",
                    p, "w")

    if L.HAVE_PREFIX:
        def set_tokens(self, tokens):
            """Record the token ids of positions [0, len(tokens)) for prefix reuse: a
            sequence of ints in int32's range (floats and bools are refused)."""
            h = self._handle()
            t = A.token_ids(tokens, "set_tokens tokens")
            self._check(L.pkv_session_set_tokens(h, t.size, t.ctypes.data),
                        "set_tokens")

    def __repr__(self):
        if self.closed:
            return "<pagedkv.Session closed>"
        return f"<pagedkv.Session len={self.len(0)}>"
