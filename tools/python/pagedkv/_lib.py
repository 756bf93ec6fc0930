"""The C library, its structs and its statuses (ctypes). Internal to the package.

The ctypes declarations below are libpagedkv's ABI of soname 2 (pkv_config and the
other structs field by field): the package loads that library and no other.
Where it is looked for, first found wins:
  1. $PAGEDKV_LIBRARY: a path to the library (tests point it at a build directory).
     When set, it is the only place tried.
  2. The installed prefix: the library directory recorded when the package was
     installed (_install.py: meson writes it beside the package; the pip backend
     writes pkg-config's libdir of pagedkv when it knows one), then the lib
     directories of the interpreter's prefix (sys.prefix: a virtual environment or
     the prefix pagedkv was installed into beside this Python).
  3. The dynamic loader's path: dlopen("libpagedkv.so.3") (LD_LIBRARY_PATH,
     the ldconfig cache, /lib and /usr/lib).
When none has it, ImportError names every place tried and why each failed.
"""
import ctypes
import os
import sys
import sysconfig

from ._errors import (OK, EINVAL, ENOMEM, EIO, ECORRUPT, ERANGE, ESTATE,  # noqa: F401
                      Error, InvalidArgument, OutOfRange, OutOfMemory, IOFailure,
                      CorruptFile, StateError, FileNotFound, IsADirectory, NotADirectory,
                      PermissionDenied, EXCEPTIONS)
from . import _args
from . import _errors

# The soname the declarations below are written for. meson.build's soversion moves
# when a public struct gains a field; tests/python/test_install.py holds this equal
# to the built library's DT_SONAME, so the two cannot drift apart unnoticed.
ABI_SONAME = "libpagedkv.so.3"

try:
    from . import _install          # written at install time (meson or pip)
except ImportError:
    _install = None
SONAME = getattr(_install, "SONAME", ABI_SONAME)


class LayerConfig(ctypes.Structure):
    _fields_ = [("window", ctypes.c_uint32), ("sink_tokens", ctypes.c_uint32),
                ("rollback_tokens", ctypes.c_uint32), ("softcap", ctypes.c_float),
                ("sink_logits", ctypes.c_void_p),
                ("rope", ctypes.c_uint32), ("rope_dims", ctypes.c_uint32),
                ("rope_theta", ctypes.c_float), ("rope_freq_scale", ctypes.c_float)]


ROPE_NORM, ROPE_NEOX = 1, 2   # pkv_layer_config.rope (docs/rope.md)


class Config(ctypes.Structure):
    _fields_ = [("n_layers", ctypes.c_uint32), ("n_heads", ctypes.c_uint32),
                ("n_kv_heads", ctypes.c_uint32), ("head_dim", ctypes.c_uint32),
                ("block_tokens", ctypes.c_uint32), ("kv_dtype", ctypes.c_int),
                ("scale", ctypes.c_float), ("mem_budget", ctypes.c_uint64),
                ("spill_dir", ctypes.c_char_p), ("n_threads", ctypes.c_uint32),
                ("head_dim_v", ctypes.c_uint32),
                ("layer_cfg", ctypes.POINTER(LayerConfig)),
                ("quant_dot", ctypes.c_uint32), ("prefix_cache_bytes", ctypes.c_uint64)]


class Memory(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in
                ("tokens", "blocks", "bytes_resident", "bytes_shared", "bytes_spilled",
                 "bytes_ideal", "bytes_overhead")]


class Stats(ctypes.Structure):
    _fields_ = [("isa", ctypes.c_char_p), ("io_backend", ctypes.c_char_p)] + \
               [(n, ctypes.c_uint64) for n in
                ("pages_in_use", "pages_free", "pages_spilled", "page_bytes",
                 "bytes_allocator", "mem_budget", "pages_cached", "prefix_lookups",
                 "prefix_hit_tokens")] + \
               [("pool", ctypes.c_char_p)] + \
               [(n, ctypes.c_uint64) for n in
                ("pages_read_shared", "pages_read_private", "page_reads_saved")]


def _prefix_libdirs():
    """Library directories of the installed prefix, most specific first."""
    dirs = []
    recorded = getattr(_install, "LIBDIR", "")
    if recorded:
        dirs.append(recorded)
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        for sub in ([os.path.join("lib", multiarch)] if multiarch else []) + ["lib64", "lib"]:
            d = os.path.join(prefix, sub)
            if d not in dirs:
                dirs.append(d)
    return dirs


def _load():
    """(CDLL, path) of the first place that has the library; ImportError naming all."""
    tried = []
    env = os.environ.get("PAGEDKV_LIBRARY")
    if env:
        try:
            return ctypes.CDLL(env), env
        except OSError as exc:
            tried.append(f"1. $PAGEDKV_LIBRARY={env}: {exc}")
        tried.append("2. the installed prefix: not tried ($PAGEDKV_LIBRARY is set)")
        tried.append("3. the dynamic loader's path: not tried ($PAGEDKV_LIBRARY is set)")
    else:
        tried.append("1. $PAGEDKV_LIBRARY: not set")
        missing = []
        for d in _prefix_libdirs():
            p = os.path.join(d, SONAME)
            if not os.path.exists(p):
                missing.append(d)
                continue
            try:
                return ctypes.CDLL(p), p
            except OSError as exc:
                tried.append(f"2. the installed prefix: {p}: {exc}")
        if missing:
            tried.append(f"2. the installed prefix: no {SONAME} in " + ", ".join(missing))
        try:
            return ctypes.CDLL(SONAME), SONAME
        except OSError as exc:
            tried.append(f"3. the dynamic loader's path (LD_LIBRARY_PATH, ldconfig): {exc}")
    raise ImportError(f"pagedkv: cannot load libpagedkv ({SONAME}). Looked in:\n  " +
                      "\n  ".join(tried) + "\nInstall it (meson install; then ldconfig "
                      "for a prefix the loader searches) or set PAGEDKV_LIBRARY to its "
                      "path.")


if SONAME != ABI_SONAME:
    raise ImportError(f"pagedkv: this package is written for {ABI_SONAME}, but was "
                      f"installed beside {SONAME}: install the package of that library's "
                      "source tree")

lib, path = _load()

P = ctypes.c_void_p
u32, u64, f32 = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_float
st = ctypes.c_int


def _fn(name, restype, *argtypes):
    f = getattr(lib, name)
    f.restype = restype
    f.argtypes = list(argtypes)
    return f


pkv_status_str = _fn("pkv_status_str", ctypes.c_char_p, st)
pkv_version = _fn("pkv_version", ctypes.c_char_p)
pkv_config_default = _fn("pkv_config_default", Config)
pkv_config_explain = _fn("pkv_config_explain", st, ctypes.POINTER(Config), ctypes.c_char_p,
                         ctypes.c_size_t)
pkv_engine_create = _fn("pkv_engine_create", st, ctypes.POINTER(Config), ctypes.POINTER(P))
pkv_engine_destroy = _fn("pkv_engine_destroy", None, P)
pkv_engine_config = _fn("pkv_engine_config", st, P, ctypes.POINTER(Config))
pkv_engine_stats = _fn("pkv_engine_stats", st, P, ctypes.POINTER(Stats))
pkv_engine_last_error = _fn("pkv_engine_last_error", st, P, ctypes.c_char_p, ctypes.c_size_t)
pkv_engine_check = _fn("pkv_engine_check", st, P)
pkv_session_create = _fn("pkv_session_create", st, P, ctypes.POINTER(P))
pkv_session_fork = _fn("pkv_session_fork", st, P, ctypes.POINTER(P))
pkv_session_destroy = _fn("pkv_session_destroy", None, P)
pkv_append = _fn("pkv_append", st, P, u32, P, P)
pkv_decode = _fn("pkv_decode", st, P, u32, P, P)
pkv_session_len = _fn("pkv_session_len", u64, P, u32)
pkv_session_truncate = _fn("pkv_session_truncate", st, P, u64)
pkv_session_memory = _fn("pkv_session_memory", st, P, ctypes.POINTER(Memory))
pkv_prefill = _fn("pkv_prefill", st, P, u32, u32, P, P, P, P)
pkv_decode_batch = _fn("pkv_decode_batch", st, P, u32, u32, P, P, P)
pkv_verify = _fn("pkv_verify", st, P, u32, u32, P, P, P, P, P)
pkv_session_commit = _fn("pkv_session_commit", st, P, u32, P)
pkv_session_save = _fn("pkv_session_save", st, P, ctypes.c_char_p)
pkv_session_load = _fn("pkv_session_load", st, P, ctypes.c_char_p, ctypes.POINTER(P))
pkv_kv_cache_bytes = _fn("pkv_kv_cache_bytes", st, u64, u64, u64, u64, u64, u64,
                         ctypes.POINTER(u64))
pkv_causal_attention = _fn("pkv_causal_attention", st, u32, u32, u32, u32, f32, P, P, P, P)
pkv_mha_forward = _fn("pkv_mha_forward", st, u32, u32, u32, u32, P, P, P, P, P, P)
pkv_attention_reference = _fn("pkv_attention_reference", st, u32, u32, u32, u32, u32, f32,
                              ctypes.POINTER(LayerConfig), P, P, P, P)
pkv_row_bytes = _fn("pkv_row_bytes", ctypes.c_size_t, ctypes.c_int, u32)
pkv_dtype_name = _fn("pkv_dtype_name", ctypes.c_char_p, ctypes.c_int)
pkv_dtype_round_row = _fn("pkv_dtype_round_row", None, ctypes.c_int, u32, P, P)

pkv_rope_q = _fn("pkv_rope_q", st, P, u32, u32, P, P)
pkv_session_discard = _fn("pkv_session_discard", st, P, u64, u64)

# The prefix cache's calls (docs/prefix-cache.md): the package works without them.
HAVE_PREFIX = hasattr(lib, "pkv_session_set_tokens") and hasattr(lib, "pkv_session_from_prefix")
if HAVE_PREFIX:
    pkv_session_set_tokens = _fn("pkv_session_set_tokens", st, P, u64, P)
    pkv_session_from_prefix = _fn("pkv_session_from_prefix", st, P, u64, P, ctypes.POINTER(P),
                                  ctypes.POINTER(u64))


def status_str(status):
    """pkv_status_str: the text of a status number (an int32)."""
    return pkv_status_str(_args.i32(status, "status")).decode()


def raise_for(status, what, reason="", errno=None, filename=None):
    """Raise the exception of a failed status: `what: status text (reason)`; with an
    errno (PKV_EIO), the OSError subclass of that errno, errno and filename set."""
    raise _errors.make(status, _errors.message(status_str(status), what, reason),
                       errno, filename)
