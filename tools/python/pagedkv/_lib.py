"""The C library, its structs and its statuses (ctypes). Internal to the package.

Where libpagedkv is looked for, first found wins:
  1. $PAGEDKV_LIBRARY: a path to libpagedkv.so (tests point it at a build directory);
  2. the library directory meson installed this package beside (_install.py, written at
     install time);
  3. the dynamic linker's search path (libpagedkv.so.2, then ctypes.util.find_library).
"""
import ctypes
import ctypes.util
import os

SONAME = "libpagedkv.so.2"

# pkv_status
OK, EINVAL, ENOMEM, EIO, ECORRUPT, ERANGE, ESTATE = range(7)


class Error(Exception):
    """Base of every pagedkv exception; `status` is the library's pkv_status (an int)."""

    def __init__(self, message, status=None):
        super().__init__(message)
        self.status = status


class InvalidArgument(Error, ValueError):
    """PKV_EINVAL: a bad argument, geometry or file of another format/geometry."""


class OutOfRange(Error, ValueError):
    """PKV_ERANGE: a position or length out of range, or a size that overflows uint64."""


class OutOfMemory(Error, MemoryError):
    """PKV_ENOMEM: the memory budget (after spilling) or the system cannot supply it."""


class IOFailure(Error, OSError):
    """PKV_EIO: an I/O call failed (spill file, save, load)."""


class CorruptFile(Error, OSError):
    """PKV_ECORRUPT: a damaged session file (checksum, truncation, padding)."""


class StateError(Error, RuntimeError):
    """PKV_ESTATE: the object is not in a state that allows the call (decode of an
    empty layer)."""


EXCEPTIONS = {EINVAL: InvalidArgument, ENOMEM: OutOfMemory, EIO: IOFailure,
              ECORRUPT: CorruptFile, ERANGE: OutOfRange, ESTATE: StateError}


class LayerConfig(ctypes.Structure):
    _fields_ = [("window", ctypes.c_uint32), ("sink_tokens", ctypes.c_uint32),
                ("rollback_tokens", ctypes.c_uint32), ("softcap", ctypes.c_float),
                ("sink_logits", ctypes.c_void_p)]


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
               [("pool", ctypes.c_char_p)]


def _candidates():
    env = os.environ.get("PAGEDKV_LIBRARY")
    if env:
        return [env]
    out = []
    try:
        from . import _install
        out.append(os.path.join(_install.LIBDIR, SONAME))
    except ImportError:
        pass
    out.append(SONAME)
    found = ctypes.util.find_library("pagedkv")
    if found:
        out.append(found)
    return out


def _load():
    errors = []
    for path in _candidates():
        try:
            return ctypes.CDLL(path), path
        except OSError as exc:
            errors.append(f"{path}: {exc}")
    raise ImportError("pagedkv: cannot load libpagedkv (set PAGEDKV_LIBRARY to its path): " +
                      "; ".join(errors))


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

# SPEC §10, present once the prefix cache is merged: the package works without them.
HAVE_PREFIX = hasattr(lib, "pkv_session_set_tokens") and hasattr(lib, "pkv_session_from_prefix")
if HAVE_PREFIX:
    pkv_session_set_tokens = _fn("pkv_session_set_tokens", st, P, u64, P)
    pkv_session_from_prefix = _fn("pkv_session_from_prefix", st, P, u64, P, ctypes.POINTER(P),
                                  ctypes.POINTER(u64))


def status_str(status):
    return pkv_status_str(status).decode()


def raise_for(status, what, reason=""):
    """Raise the exception of a failed status: `what: status text (reason)`."""
    msg = f"{what}: {status_str(status)}"
    if reason:
        msg += f" ({reason})"
    raise EXCEPTIONS.get(status, Error)(msg, status)
