"""pagedkv: a paged KV cache and decode attention for token-by-token generators.

Python bindings (ctypes, no compiled code) of libpagedkv; docs/python.md walks through
them. Arrays are numpy float32; a float32 C-contiguous array is passed to the library
as it is (no copy), anything else (other dtypes, strides, nested lists) is converted.

    import pagedkv
    with pagedkv.Engine(n_layers=1, n_heads=8, n_kv_heads=2, head_dim=64) as e:
        with e.session() as s:
            s.append(0, k, v)        # k, v: [n_kv_heads][head_dim]
            out = s.decode(0, q)     # q: [n_heads][head_dim] -> [n_heads][head_dim]

Statuses become exceptions: PKV_EINVAL InvalidArgument (a ValueError), PKV_ERANGE
OutOfRange (a ValueError), PKV_ENOMEM OutOfMemory (a MemoryError), PKV_EIO IOFailure
(an OSError; FileNotFound, IsADirectory, NotADirectory, PermissionDenied - also
FileNotFoundError etc. - with errno and filename when the OS says why), PKV_ECORRUPT
CorruptFile (an OSError), PKV_ESTATE StateError (a RuntimeError); all are
pagedkv.Error with .status, and carry the library's reason (pkv_engine_last_error) in
their message. Arguments are checked before any call (TypeError, ValueError,
OverflowError): ctypes would wrap an out-of-range integer silently.
"""
from ._errors import (Error, InvalidArgument, OutOfRange, OutOfMemory, IOFailure,
                      CorruptFile, StateError, FileNotFound, IsADirectory, NotADirectory,
                      PermissionDenied)
from ._lib import HAVE_PREFIX, path as library_path
from ._lib import OK, EINVAL, ENOMEM, EIO, ECORRUPT, ERANGE, ESTATE, status_str
from ._engine import Engine, Session, DTYPES
from ._textbook import kv_cache_bytes, causal_attention, multi_head_attention
from . import _lib

F32, F16, BF16, Q8, Q4 = (DTYPES[n] for n in ("f32", "f16", "bf16", "q8", "q4"))

__version__ = _lib.pkv_version().decode()


def version():
    """The library's version, "MAJOR.MINOR.PATCH"."""
    return _lib.pkv_version().decode()


def pool():
    """The page pool engines of this process get: "jemalloc" (the process's jemalloc,
    or a private one pagedkv could load) or "aligned" (aligned_alloc)."""
    with Engine(n_layers=1, n_heads=1, n_kv_heads=1, head_dim=1, n_threads=1) as e:
        return e.stats()["pool"]


__all__ = ["Engine", "Session", "Error", "InvalidArgument", "OutOfRange", "OutOfMemory",
           "IOFailure", "CorruptFile", "StateError", "FileNotFound", "IsADirectory",
           "NotADirectory", "PermissionDenied", "kv_cache_bytes", "causal_attention",
           "multi_head_attention", "version", "pool", "status_str", "library_path",
           "F32", "F16", "BF16", "Q8", "Q4", "HAVE_PREFIX"]
