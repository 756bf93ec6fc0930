"""The package's exceptions: one class per pkv_status, each also the built-in exception
a Python user expects, and the OS reason of a failed file call. Internal; the classes
are re-exported by the package.

    Error                                  (Exception; .status)
    +-- InvalidArgument  (ValueError)      PKV_EINVAL
    +-- OutOfRange       (ValueError)      PKV_ERANGE
    +-- OutOfMemory      (MemoryError)     PKV_ENOMEM
    +-- StateError       (RuntimeError)    PKV_ESTATE
    +-- CorruptFile      (OSError)         PKV_ECORRUPT
    +-- IOFailure        (OSError)         PKV_EIO
        +-- FileNotFound      (FileNotFoundError)    ENOENT
        +-- IsADirectory      (IsADirectoryError)    EISDIR
        +-- NotADirectory     (NotADirectoryError)   ENOTDIR
        +-- PermissionDenied  (PermissionError)      EACCES, EPERM

The library reports a failed open, read, write or rename as PKV_EIO (and a directory
given to pkv_session_load as PKV_EINVAL, "not a regular file") and says why in words
(pkv_engine_last_error); the errno is gone by then. os_reason() finds it again by
asking the OS the same question about the path (stat, access) right after the
failure, so that `except FileNotFoundError` works and errno and filename are set.
"""
import errno as E
import os

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


class StateError(Error, RuntimeError):
    """PKV_ESTATE: the object is not in a state that allows the call (decode of an
    empty layer)."""


class _OSErrorStatus(Error, OSError):
    """An OSError that is also a pagedkv.Error. When the OS reason is known, errno,
    strerror (the OS's words) and filename are set as OSError sets them, and str() is
    the library's message followed by "[Errno N] strerror"; else errno is None and
    str() is the message alone."""

    def __init__(self, message, status=None, errno=None, filename=None):
        if errno is None:
            OSError.__init__(self, message)
        else:
            OSError.__init__(self, errno, os.strerror(errno), filename)
        self.status = status
        self.message = message

    def __str__(self):
        if self.errno is None:
            return self.message
        return f"{self.message}: [Errno {self.errno}] {self.strerror}"


class CorruptFile(_OSErrorStatus):
    """PKV_ECORRUPT: a damaged session file (checksum, truncation, padding)."""


class IOFailure(_OSErrorStatus):
    """PKV_EIO: an I/O call failed (spill file, save, load); errno and filename are
    set when the OS reason is known, and the class is then one of the subclasses
    below where Python has one for that errno."""


class FileNotFound(IOFailure, FileNotFoundError):
    """The file, or a directory on its path, does not exist (PKV_EIO)."""


class IsADirectory(IOFailure, IsADirectoryError):
    """The path names a directory where a file goes (PKV_EIO from a save; PKV_EINVAL,
    "not a regular file", from a load: `status` says which)."""


class NotADirectory(IOFailure, NotADirectoryError):
    """A component of the path is not a directory (PKV_EIO)."""


class PermissionDenied(IOFailure, PermissionError):
    """The process may not read (load) or write (save, spill) there (PKV_EIO)."""


EXCEPTIONS = {EINVAL: InvalidArgument, ENOMEM: OutOfMemory, EIO: IOFailure,
              ECORRUPT: CorruptFile, ERANGE: OutOfRange, ESTATE: StateError}
_BY_ERRNO = {E.ENOENT: FileNotFound, E.EISDIR: IsADirectory, E.ENOTDIR: NotADirectory,
             E.EACCES: PermissionDenied, E.EPERM: PermissionDenied}


def message(status_text, what, reason=""):
    msg = f"{what}: {status_text}"
    if reason:
        msg += f" ({reason})"
    return msg


def make(status, msg, errno=None, filename=None):
    """The exception of a failed status. With an errno (the OS reason of a failed
    file call: PKV_EIO, or PKV_EINVAL for a directory where a file goes), an
    IOFailure of that errno's class, errno and filename set, `status` the library's."""
    if errno is not None and status in (EIO, EINVAL):
        return _BY_ERRNO.get(errno, IOFailure)(msg, status, errno, filename)
    if status == EIO:
        return IOFailure(msg, status)
    if status == ECORRUPT:
        return CorruptFile(msg, status)
    return EXCEPTIONS.get(status, Error)(msg, status)


def _errno_of(call, *args):
    try:
        call(*args)
    except OSError as exc:
        return exc.errno
    return None


def os_reason(path, mode):
    """The errno that explains why the library could not open `path` for `mode`:
    "r" (read a file), "w" (create or replace a file, through a temporary file in its
    directory and a rename), "d" (a directory to create files in). None when the OS
    sees nothing wrong (the failure was elsewhere: a short read, a full disk)."""
    path = os.fsdecode(path)
    if mode == "r":
        err = _errno_of(os.stat, path)
        if err is not None:
            return err
        if os.path.isdir(path):
            return E.EISDIR
        return None if os.access(path, os.R_OK) else E.EACCES
    if mode == "w":
        if os.path.isdir(path):
            return E.EISDIR
        directory = os.path.dirname(path) or "."
    else:
        directory = path
    err = _errno_of(os.stat, directory)
    if err is not None:
        return err
    if not os.path.isdir(directory):
        return E.ENOTDIR
    if not os.access(directory, os.W_OK | os.X_OK):
        return E.EROFS if _read_only_fs(directory) else E.EACCES
    return None


def _read_only_fs(directory):
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        return False
