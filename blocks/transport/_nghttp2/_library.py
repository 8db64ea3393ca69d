"""libnghttp2 as the codec reaches it: through the C shim (:mod:`._shim`) where it loads, else in cffi's
ABI mode (:mod:`._ffi`); the library's constants the codec uses, its errors as the contract's, and the
small helpers every module of the codec shares.

Importing this module loads the library, or raises ``ImportError`` with the one-line reason.
"""

from __future__ import annotations

import struct
from typing import Any, cast

import h2.exceptions

from blocks.transport._codec import ErrorCodes
from blocks.transport._nghttp2 import _shim
from blocks.transport._nghttp2._ffi import load

_loaded = _shim.load()
SHIM_REASON = _loaded if isinstance(_loaded, str) else ""
"""Why the C shim is not in use (empty when it is): the codec then runs in cffi's ABI mode."""
if isinstance(_loaded, str):
    _loaded = load()
    if isinstance(_loaded, str):
        raise ImportError(_loaded)  # noqa: TRY004 (what a missing library is to the importer)
ffi, lib = _loaded
SHIM = not SHIM_REASON
MODE = "shim" if SHIM else "abi"
"""How the codec reaches the library: ``"shim"`` (cffi's API mode, the callbacks in C) or ``"abi"``."""

CALLBACK_FAILURE = -902  # NGHTTP2_ERR_CALLBACK_FAILURE
DEFERRED = -508  # NGHTTP2_ERR_DEFERRED
DATA_EOF = 0x1
DATA_NO_END_STREAM = 0x2
END_STREAM = 0x1
STREAM_STATE_CLOSED = 7  # NGHTTP2_STREAM_STATE_CLOSED
SETTINGS_MAX_CONCURRENT_STREAMS = 3
SETTINGS_INITIAL_WINDOW_SIZE = 4
SETTINGS_MAX_FRAME_SIZE = 5
SETTINGS_ENABLE_CONNECT_PROTOCOL = 8

if SHIM:  # (API mode's ffi is cffi's C object itself)
    from_handle, unpack, from_buffer, new = ffi.from_handle, ffi.unpack, ffi.from_buffer, ffi.new
else:  # (ABI mode's is Python: its C functions, without the wrappers)
    _backend = ffi._backend
    from_handle, unpack, from_buffer, new = _backend.from_handle, _backend.unpack, _backend.from_buffer, _backend.newp
unpack_head = struct.Struct(">BHBBL").unpack_from  # a frame header: its length (high, low), type, flags, stream


class NgProtocolError(h2.exceptions.ProtocolError):
    """A protocol error the nghttp2 codec found or was asked about: ``error_code`` is what its GOAWAY says."""

    def __init__(self, message: str, error_code: int = ErrorCodes.PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.error_code = cast(ErrorCodes, error_code)  # (a code the RFC does not name stays an int)


class NgStreamClosedError(NgProtocolError):
    """A call about a stream the session does not have open (h2's ``StreamClosedError``)."""


def check(rv: int) -> None:
    """A library call's return value: an error as the contract's exception."""
    if rv < 0:
        message = ffi.string(lib.nghttp2_strerror(rv)).decode()
        if rv in (-510, -501):  # NGHTTP2_ERR_STREAM_CLOSED, NGHTTP2_ERR_INVALID_ARGUMENT on a stream
            raise NgStreamClosedError(message, ErrorCodes.STREAM_CLOSED)
        raise NgProtocolError(message)


def wire_code(value: int) -> int:
    """An error code off the wire: an ``ErrorCodes`` member, or the int where the RFC names none."""
    try:
        return ErrorCodes(value)
    except ValueError:
        return value


_LIB_TO_CODE = {
    -505: ErrorCodes.PROTOCOL_ERROR,  # NGHTTP2_ERR_PROTO
    -510: ErrorCodes.STREAM_CLOSED,  # NGHTTP2_ERR_STREAM_CLOSED
    -522: ErrorCodes.FRAME_SIZE_ERROR,  # NGHTTP2_ERR_FRAME_SIZE_ERROR
    -524: ErrorCodes.FLOW_CONTROL_ERROR,  # NGHTTP2_ERR_FLOW_CONTROL
    -523: ErrorCodes.COMPRESSION_ERROR,  # NGHTTP2_ERR_HEADER_COMP
    -535: ErrorCodes.REFUSED_STREAM,  # NGHTTP2_ERR_REFUSED_STREAM
}


def stream_error_code(lib_error: int) -> int:
    """The RST_STREAM code of a stream error the library found (its ``NGHTTP2_ERR_*``)."""
    return _LIB_TO_CODE.get(lib_error, ErrorCodes.PROTOCOL_ERROR)


def goaway(last_stream_id: int, code: int) -> bytes:
    """A GOAWAY frame, without debug data."""
    return (8 << 48 | 0x7 << 40).to_bytes(9) + last_stream_id.to_bytes(4) + int(code).to_bytes(4)


failures: list[BaseException] = []
"""What a callback raised (:func:`keep_failure`), for the codec to re-raise after the library call."""


def keep_failure(exc_type: Any, exc: BaseException, tb: Any) -> None:
    """A callback raised: kept for the codec to re-raise after the library call (cffi would print it)."""
    failures.append(exc)
