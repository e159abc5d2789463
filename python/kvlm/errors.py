"""kvlm.errors: the exceptions kvlm raises, one per kind of C status
(kvlm.h's KVLM_E* codes), each carrying the C library's message."""
from __future__ import annotations

from typing import Dict, Optional, Type


class KvlmError(Exception):
    """An error the C library reported: ``code`` is its KVLM_E* status,
    ``str(e)`` its message."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class KvlmIOError(KvlmError, OSError):
    """A file could not be opened, read or written (KVLM_EIO)."""


class ModelNotFoundError(KvlmIOError, FileNotFoundError):
    """The model path names nothing."""


class ModelFormatError(KvlmError, ValueError):
    """A model file (or other input) is malformed or truncated (KVLM_EFORMAT)."""


class InvalidArgumentError(KvlmError, ValueError):
    """A bad argument or a value out of range (KVLM_EINVAL, KVLM_ERANGE)."""


class KvlmMemoryError(KvlmError, MemoryError):
    """An allocation failed (KVLM_ENOMEM)."""


class UnsupportedError(KvlmError):
    """An architecture, type or feature kvlm lacks (KVLM_EUNSUPPORTED)."""


class KvMemoryError(KvlmError):
    """The KV cache has no room (KVLM_EFULL, or a completion ended for lack of KV blocks)."""


class CancelledError(KvlmError):
    """Work was cancelled (KVLM_ECANCELED)."""


_BY_CODE: Dict[int, Type[KvlmError]] = {
    1: KvlmIOError, 2: ModelFormatError, 3: InvalidArgumentError, 4: KvlmMemoryError,
    5: InvalidArgumentError, 6: UnsupportedError, 7: KvMemoryError, 8: CancelledError,
}


def from_code(code: int, message: str, cls: Optional[Type[KvlmError]] = None) -> KvlmError:
    """The exception for a C status and message."""
    return (cls or _BY_CODE.get(code, KvlmError))(message, code)


def raise_err(err: object, cls: Optional[Type[KvlmError]] = None) -> None:
    """Raises the exception a filled kvlm_error stands for."""
    code = int(getattr(err, "code"))
    msg = bytes(getattr(err, "msg")).split(b"\0", 1)[0].decode("utf-8", "replace") or "kvlm error %d" % code
    raise from_code(code, msg, cls)
