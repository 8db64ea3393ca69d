"""How the library's reports on what it received reach a codec: the shim's record replayed
(:func:`replay`, once per call into the library), or, in ABI mode, a C callback per report; both end
in :func:`on_frame` (a frame received, as the contract's events) and :func:`on_invalid`.

Callbacks only record (the rules are in ``_codec``'s docstring): nothing here calls into the session.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

import h2.exceptions

from blocks.transport._codec import ProtocolError
from blocks.transport._nghttp2 import _events as events
from blocks.transport._nghttp2._library import (
    CALLBACK_FAILURE,
    END_STREAM,
    SHIM,
    check,
    ffi,
    from_handle,
    keep_failure,
    lib,
    stream_error_code,
    unpack,
    wire_code,
)

if TYPE_CHECKING:
    from blocks.transport._nghttp2._codec import NgCodec

unpack_from = struct.unpack_from


def on_frame(codec: NgCodec, kind: int, flags: int, sid: int, flow: int, a: int, b: int, extra: Any) -> None:
    """A frame received, as the library reports it (see :mod:`._shim` for ``a``, ``b``, ``extra``)."""
    evs = codec._events
    if kind == 0:  # DATA
        chunks = codec._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        if len(data) != flow:
            # Padded, or behind the chunks of a frame the library dropped without a word (its stream
            # closed while the frame was coming in): this frame's own bytes are the last ones.
            padding = a
            data = data[len(data) - (flow - padding) :]
            if padding:
                # (the library gives padding back itself: the driver's acknowledgement of it is not
                # passed on, see acknowledge_received_data)
                codec._padding[sid] = codec._padding.get(sid, 0) + padding
        ended = True if flags & END_STREAM else None
        codec._received += flow
        run = codec._runs.get(sid)
        if run is not None:  # (the stream's DATA of this read so far, and none of its other events)
            run.data += data
            run.flow_controlled_length += flow
            run.stream_ended = ended
        else:
            run = codec._runs[sid] = events.DataReceived(sid, data, flow, ended)
            evs.append(run)
        if ended:
            del codec._runs[sid]
            evs.append(events.StreamEnded(sid))
    elif kind == 1:  # HEADERS
        if codec._runs:
            codec._runs.pop(sid, None)
        block = codec._block if codec._block_size else []
        codec._block = []
        codec._block_size = 0
        ended = True if flags & END_STREAM else None
        heads = codec._heads
        if sid in heads:
            evs.append(events.TrailersReceived(sid, block, ended))
        elif codec.client_side:
            status = block[0][1] if block and block[0][0] == b":status" else b""
            if status[:1] == b"1" and len(status) == 3:
                if ended:  # (an informational response may not end the stream: the stream's error)
                    evs.append(events.ResponseReceived(sid, block, ended))
                    evs.append(events.StreamEnded(sid))
                    heads.add(sid)
                return  # informational: the final head is still to come
            heads.add(sid)
            evs.append(events.ResponseReceived(sid, block, ended))
        else:
            heads.add(sid)
            if sid > codec._highest_inbound:
                codec._highest_inbound = sid
            evs.append(events.RequestReceived(sid, block, ended))
        if ended:
            evs.append(events.StreamEnded(sid))
    elif kind == 3:  # RST_STREAM
        if sid not in codec._heads and sid not in codec._opened:
            return  # (on a stream closed: the library reports it all the same)
        codec._runs.pop(sid, None)
        codec._reset_reported.add(sid)
        evs.append(events.StreamReset(sid, wire_code(a)))
    elif kind == 8:  # WINDOW_UPDATE
        if codec._runs:
            codec._runs.pop(sid, None)
        evs.append(events.WindowUpdated(sid, a))
    elif kind == 4:  # SETTINGS
        if not flags & 0x1:
            codec._settings_received(extra)
            evs.append(events.RemoteSettingsChanged())
    elif kind == 7:  # GOAWAY
        evs.append(events.ConnectionTerminated(wire_code(b), a, extra))
    elif kind == 6 and flags & 0x1:  # PING ACK (the library answers a PING itself)
        evs.append(events.PingAckReceived())


def replay(codec: NgCodec) -> None:
    """What the shim recorded (see :mod:`._shim`), in order, as the ABI-mode callbacks report it."""
    log = codec._log
    view = ffi.buffer(log.buf, log.len)
    size = log.len
    log.len = 0
    unpack = unpack_from
    pos = 0
    try:
        while pos < size:
            tag = view[pos]
            if tag == b"B":
                count, total = unpack("=II", view, pos + 1)
                lengths = unpack(f"={2 * count}I", view, pos + 9)
                start = pos + 9 + 8 * count
                pos = start + total
                blob = view[start:pos]
                block = []
                at = 0
                for i in range(0, 2 * count, 2):
                    middle = at + lengths[i]
                    end = middle + lengths[i + 1]
                    block.append((blob[at:middle], blob[middle:end]))
                    at = end
                codec._block = block
                codec._block_size = 1 if block else 0  # (only whether there is one is read)
            elif tag == b"F":
                kind, flags, sid, length, a, b = unpack("=BBiIII", view, pos + 1)
                pos += 19
                extra: Any = None
                if kind == 7:
                    (count,) = unpack("=I", view, pos)
                    extra = view[pos + 4 : pos + 4 + count]
                    pos += 4 + count
                elif kind == 4:
                    pairs = unpack(f"={2 * a}I", view, pos)
                    extra = list(zip(pairs[::2], pairs[1::2], strict=True))
                    pos += 8 * a
                on_frame(codec, kind, flags, sid, length, a, b, extra)
            elif tag == b"D":
                _sid, length = unpack("=iI", view, pos + 1)
                codec._chunks.append(view[pos + 9 : pos + 9 + length])
                pos += 9 + length
            elif tag == b"C":
                sid, code = unpack("=iI", view, pos + 1)
                pos += 9
                codec._on_stream_close(sid, code)
            elif tag == b"I":
                sid, lib_error = unpack("=ii", view, pos + 1)
                pos += 9
                on_invalid(codec, sid, lib_error)
            else:  # E
                (length,) = unpack("=I", view, pos + 1)
                codec._error_message = view[pos + 5 : pos + 5 + length].decode(errors="replace")
                pos += 5 + length
    except ProtocolError as exc:  # (a connection error found in a frame: the library went on past it)
        codec._error = exc
        raise codec._fatal(CALLBACK_FAILURE) from None


def on_invalid(codec: NgCodec, sid: int, lib_error: int) -> None:
    codec._error_message = ffi.string(lib.nghttp2_strerror(lib_error)).decode()
    codec._block = []  # (a header block cut short)
    codec._block_size = 0
    if sid and sid in codec._heads and sid not in codec._reset_reported:
        # The session resets the stream itself (a stream error): the driver hears of it once.
        codec._reset_reported.add(sid)
        codec._runs.pop(sid, None)
        codec._events.append(events.StreamReset(sid, stream_error_code(lib_error), remote_reset=False))


# -- the C callbacks: ABI mode's, and a DATA source's read in both (each finds its codec through user_data) --


def _codec_of(user_data: Any) -> NgCodec:
    codec: NgCodec = from_handle(user_data)
    return codec


def _on_header(
    session: Any, frame: Any, name: Any, namelen: int, value: Any, valuelen: int, flags: int, user_data: Any
) -> int:
    codec: NgCodec = from_handle(user_data)
    size = codec._block_size + namelen + valuelen + 32
    if size > codec._cap:
        codec._error = h2.exceptions.DenialOfServiceError(
            f"header block over {codec._cap} bytes decoded (an HPACK bomb?)"
        )
        return CALLBACK_FAILURE
    if not codec._block_size:
        codec._block = []
    codec._block_size = size
    codec._block.append((unpack(name, namelen), unpack(value, valuelen)))
    return 0


def _on_frame_recv(session: Any, frame: Any, user_data: Any) -> int:
    hd = frame.hd
    kind = hd.type
    a = b = 0
    extra: Any = None
    if kind == 0:
        a = frame.data.padlen
    elif kind == 3:
        a = frame.rst_stream.error_code
    elif kind == 8:
        a = frame.window_update.window_size_increment
    elif kind == 4:
        settings = frame.settings
        extra = [(settings.iv[i].settings_id, settings.iv[i].value) for i in range(settings.niv)]
    elif kind == 7:
        goaway = frame.goaway
        a, b = goaway.last_stream_id, goaway.error_code
        extra = unpack(goaway.opaque_data, goaway.opaque_data_len) if goaway.opaque_data_len else b""
    on_frame(_codec_of(user_data), kind, hd.flags, hd.stream_id, hd.length, a, b, extra)
    return 0


def _on_data_chunk(session: Any, flags: int, stream_id: int, data: Any, length: int, user_data: Any) -> int:
    from_handle(user_data)._chunks.append(unpack(data, length))
    return 0


def _on_invalid_frame(session: Any, frame: Any, lib_error: int, user_data: Any) -> int:
    on_invalid(_codec_of(user_data), frame.hd.stream_id, lib_error)
    return 0


def _on_stream_close(session: Any, stream_id: int, error_code: int, user_data: Any) -> int:
    _codec_of(user_data)._on_stream_close(stream_id, error_code)
    return 0


def _on_error(session: Any, lib_error: int, message: Any, length: int, user_data: Any) -> int:
    _codec_of(user_data)._error_message = ffi.unpack(message, length).decode(errors="replace")
    return 0


def _read(session: Any, stream_id: int, buf: Any, length: int, flags: Any, source: Any, user_data: Any) -> int:
    return _codec_of(source.ptr)._read(stream_id, buf, length, flags)


_KEEP: list[Any] = []  # the C callbacks, alive as long as the module (the library keeps only pointers)


def _c(kind: str, function: Any) -> Any:
    """``function`` as a C callback of type ``kind``: an exception in it is kept (:func:`keep_failure`)
    and the library told the callback failed, never a 0 that says it went well."""
    return ffi.callback(kind, function, error=CALLBACK_FAILURE, onerror=keep_failure)


def _make_callbacks() -> Any:
    pointer = ffi.new("nghttp2_session_callbacks **")
    check(lib.nghttp2_session_callbacks_new(pointer))
    callbacks = ffi.gc(pointer[0], lib.nghttp2_session_callbacks_del)
    if SHIM:
        lib.pb_set_callbacks(callbacks)  # (recording in C: see _shim)
        return callbacks
    for setter, kind, function in (
        ("on_header_callback", "nghttp2_on_header_callback", _on_header),
        ("on_frame_recv_callback", "nghttp2_on_frame_recv_callback", _on_frame_recv),
        ("on_data_chunk_recv_callback", "nghttp2_on_data_chunk_recv_callback", _on_data_chunk),
        ("on_invalid_frame_recv_callback", "nghttp2_on_invalid_frame_recv_callback", _on_invalid_frame),
        ("on_stream_close_callback", "nghttp2_on_stream_close_callback", _on_stream_close),
        ("error_callback2", "nghttp2_error_callback2", _on_error),
    ):
        callback = _c(kind, function)
        _KEEP.append(callback)
        getattr(lib, f"nghttp2_session_callbacks_set_{setter}")(callbacks, callback)
    return callbacks


CALLBACKS = _make_callbacks()  # (the library copies them into each session)
READ = _c("nghttp2_data_source_read_callback", _read)  # (each codec's provider names it)
