"""Arguments on their way into C. Internal to the package.

ctypes converts without asking: an int is taken modulo 2**32 for a uint32_t (a layer of
2**32 + 1 is layer 1, a window of -1 is 4294967295), int(1.9) is 1, a float that a C
float cannot hold becomes inf or 0, a bytes path stops at its first NUL. So every value
the package hands to libpagedkv passes one of these checks first, and a value the C
type cannot hold exactly is refused before anything is called:

    TypeError      not the kind of value the parameter takes: a float, str or None
                   where an integer goes; a bool anywhere a number goes (True is not
                   layer 1); token ids that are not integers; complex or text arrays
    ValueError     the right kind, outside what the parameter means: a negative
                   count or index, a NaN or infinite float, an array of another shape,
                   a path with a NUL byte
    OverflowError  an integer (or token id) beyond its C type: >= 2**32 for uint32_t,
                   >= 2**64 for uint64_t, outside [-2**31, 2**31) for int32_t; a
                   finite float beyond float32's range

Integers are int or any numpy integer (operator.index); floats are any real number
that is not a bool. The library then checks what only it knows (a layer below
n_layers, a geometry it supports) and says so with its own status.
"""
import ctypes
import math
import numbers
import operator
import os

import numpy as np

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
I32_MIN, I32_MAX = -2**31, 2**31 - 1


def _is_bool(value):
    return isinstance(value, (bool, np.bool_))


def integer(value, what):
    """value as a Python int: an int or a numpy integer, never a bool, float or str."""
    if not _is_bool(value):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{what}: expected an integer, got {type(value).__name__} {value!r}")


def unsigned(value, what, top):
    """An integer in 0..top (a C unsigned type's maximum)."""
    v = integer(value, what)
    if v < 0:
        raise ValueError(f"{what} {v}: must be >= 0")
    if v > top:
        raise OverflowError(f"{what} {v}: does not fit the C type (at most {top})")
    return v


def u32(value, what):
    return unsigned(value, what, U32_MAX)


def u64(value, what):
    return unsigned(value, what, U64_MAX)


def i32(value, what):
    v = integer(value, what)
    if not I32_MIN <= v <= I32_MAX:
        raise OverflowError(f"{what} {v}: does not fit an int32 "
                            f"({I32_MIN}..{I32_MAX})")
    return v


def flag(value, what):
    """A 0/1 switch: a bool, or the integers 0 and 1 (anything else is the library's
    to refuse, as a uint32_t)."""
    if _is_bool(value):
        return int(value)
    return u32(value, what)


def real(value, what):
    """A finite real number a C float holds (its value rounded to float32, not turned
    into inf or a zero)."""
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what}: expected a real number, got {type(value).__name__} "
                        f"{value!r}")
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"{what} {x}: must be finite")
    f = ctypes.c_float(x).value
    if math.isinf(f) or (f == 0.0 and x != 0.0):
        raise OverflowError(f"{what} {x}: out of the range of a float32")
    return x


def path(value, what):
    """A file system path (str, bytes or os.PathLike) as the bytes C reads."""
    try:
        b = os.fsencode(value)
    except TypeError:
        raise TypeError(f"{what}: expected a path (str, bytes or os.PathLike), got "
                        f"{type(value).__name__} {value!r}") from None
    if b"\0" in b:
        raise ValueError(f"{what} {value!r}: embedded null byte")
    return b


def float32(x, shape, what):
    """x as a float32 C-contiguous array of `shape` (or a flat array of its size): the
    same object when it already is one (no copy), else a converted copy. Real numbers
    only (float, integer; not bool, complex, text or objects); a finite value a
    float32 cannot hold is refused, not made infinite."""
    a = x if isinstance(x, np.ndarray) else np.asarray(x)
    if a.dtype.kind not in "fiu":
        raise TypeError(f"{what}: expected an array of real numbers, got dtype {a.dtype}")
    if a.dtype != np.float32 or not a.flags.c_contiguous:
        with np.errstate(over="ignore", invalid="ignore"):
            b = np.ascontiguousarray(a, dtype=np.float32)
        if a.dtype.kind == "f" and a.dtype.itemsize > 4:
            overflow = np.isinf(b) & np.isfinite(a)
            if overflow.any():
                i = int(np.flatnonzero(overflow)[0])
                raise OverflowError(f"{what}: value {a.reshape(-1)[i]!r} (element {i}) is "
                                    "out of the range of a float32")
        a = b
    if a.shape != tuple(shape):
        n = 1
        for s in shape:
            n *= s
        if a.ndim != 1 or a.size != n:
            raise ValueError(f"{what}: shape {a.shape}, expected {tuple(shape)}")
    return a


def out_array(out, shape, what, *inputs):
    """A float32 C-contiguous writable array of `shape` for results: `out` itself if
    given (written in place), else a new one. `out` may not overlap an input: the
    library reads its inputs while it writes."""
    if out is None:
        return np.empty(shape, dtype=np.float32)
    n = 1
    for s in shape:
        n *= s
    if (not isinstance(out, np.ndarray) or out.dtype != np.float32 or
            not out.flags.c_contiguous or not out.flags.writeable or out.size != n):
        raise ValueError(f"{what}: out must be a writable C-contiguous float32 array of "
                         f"shape {tuple(shape)}")
    for a in inputs:
        if np.may_share_memory(out, a):
            raise ValueError(f"{what}: out overlaps an input array")
    return out


def token_ids(tokens, what):
    """Token ids as a flat int32 C-contiguous array: a sequence (or 1-D array) of
    integers, each in int32's range. Floats (even 2.0), bools and text are refused,
    never truncated; an id outside int32 is an OverflowError, never wrapped."""
    if isinstance(tokens, (str, bytes, bytearray)):
        raise TypeError(f"{what}: expected a sequence of integer token ids, got "
                        f"{type(tokens).__name__}")
    a = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
    if a.ndim != 1:
        raise ValueError(f"{what}: expected a 1-D sequence of token ids, got shape "
                         f"{a.shape}")
    if a.size == 0:
        return np.empty(0, dtype=np.int32)
    if a.dtype.kind == "O":      # Python ints beyond int64, or mixed objects
        a = np.array([i32(t, f"{what}[{i}]") for i, t in enumerate(a)], dtype=np.int32)
    elif a.dtype.kind not in "iu":
        raise TypeError(f"{what}: token ids must be integers, got dtype {a.dtype}")
    lo, hi = int(a.min()), int(a.max())
    if lo < I32_MIN or hi > I32_MAX:
        bad = lo if lo < I32_MIN else hi
        raise OverflowError(f"{what}: token id {bad} does not fit an int32")
    return np.ascontiguousarray(a, dtype=np.int32)
