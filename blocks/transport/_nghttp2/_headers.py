"""Header lists handed to the library: :func:`submit_headers` (a head or trailers) and :func:`nv_array`
(the ``nghttp2_nv[]`` a DATA source's trailers take).

The library copies the fields it is given, so each call's buffers need live only as long as it.
"""

from __future__ import annotations

import struct
from typing import Any

import hpack

from blocks.transport._nghttp2._library import SHIM, ffi, from_buffer, lib, new

_NO_INDEX = 0x1  # NGHTTP2_NV_FLAG_NO_INDEX
_CHAR_ARRAY = ffi.typeof("char[]")
_NV_ARRAY = ffi.typeof("nghttp2_nv[]")
_NEVER_INDEXED = hpack.NeverIndexedHeaderTuple
_NV_FORMAT = "QQQQB7x"  # name, value, namelen, valuelen, flags: nghttp2_nv on an LP64 ABI (40 bytes)
_NV_PACKED = (
    ffi.sizeof("nghttp2_nv") == struct.calcsize("=" + _NV_FORMAT)
    and ffi.sizeof("void *") == 8
    and [ffi.offsetof("nghttp2_nv", f) for f in ("name", "value", "namelen", "valuelen", "flags")] == [0, 8, 16, 24, 32]
)
_pack = struct.pack


def flatten(headers: Any) -> tuple[list[bytes], bytes, bytearray]:
    """A header list's names and values in order, joined into one buffer, and each field's nv flags
    (never-indexed for an ``hpack.NeverIndexedHeaderTuple``)."""
    parts = []
    flags = bytearray()
    for field in headers:
        name, value = field
        parts.append(name)
        parts.append(value)
        flags.append(_NO_INDEX if type(field) is _NEVER_INDEXED else 0)
    try:
        joined = b"".join(parts)
    except TypeError:  # (a field given as str: encoded as h2 would)
        parts = [part.encode() if isinstance(part, str) else bytes(part) for part in parts]
        joined = b"".join(parts)
    return parts, joined, flags


def nv_array(headers: Any) -> tuple[Any, Any]:
    """A header list as ``nghttp2_nv[]``; the second item, the buffers it points into, must live as
    long as the call that takes the array (the library copies the fields).

    The array is packed by ``struct`` in one call where ``nghttp2_nv`` has the layout of an LP64 ABI
    (:data:`_NV_PACKED`), field by field through cffi elsewhere.
    """
    parts, joined, flags = flatten(headers)
    base = from_buffer(_CHAR_ARRAY, joined, False)
    count = len(flags)
    if _NV_PACKED:
        at = int(ffi.cast("uintptr_t", base))
        flat: list[int] = []
        for i in range(count):
            name = len(parts[2 * i])
            value = len(parts[2 * i + 1])
            flat += (at, at + name, name, value, flags[i])
            at += name + value
        packed = _pack(_NV_FORMAT * count, *flat)
        return from_buffer(_NV_ARRAY, packed, False), (base, packed)
    fields = []
    at = 0
    for i in range(count):
        name = len(parts[2 * i])
        value = len(parts[2 * i + 1])
        fields.append((base + at, base + at + name, name, value, flags[i]))
        at += name + value
    return new(_NV_ARRAY, fields), base


def submit_headers(session: Any, flags: int, stream_id: int, headers: Any) -> int:
    """``nghttp2_submit_headers`` of a header list: through the shim's ``pb_submit_headers`` (the names
    and values in one buffer, their lengths and flags in two more), or an ``nghttp2_nv`` array."""
    if not SHIM:
        nva, _keep = nv_array(headers)
        return int(lib.nghttp2_submit_headers(session, flags, stream_id, ffi.NULL, nva, len(headers), ffi.NULL))
    parts, joined, flagged = flatten(headers)
    lengths = _pack(f"={len(parts)}I", *map(len, parts))
    return int(lib.pb_submit_headers(session, flags, stream_id, joined, lengths, bytes(flagged), len(flagged)))
