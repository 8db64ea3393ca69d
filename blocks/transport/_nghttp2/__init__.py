"""The libnghttp2 codec: HTTP/2 in C behind the :class:`~blocks.transport._codec.Codec` contract.

libnghttp2 (the HTTP/2 library of curl, nghttpx and Apache httpd) parses
and frames; this package adapts it to the contract the drivers hold every
codec to, and keeps what the library leaves to its application: the abuse
limits of a server (the same :class:`~blocks.transport._codec.GuardedFrameBuffer`
checks, run over each read's frame headers before the library sees them),
the cap on a header list counted while decoding (the library would expand
an HPACK bomb into a callback per field), the statuses and error codes of
the project's limits, and validation at the edge (the session runs without
its HTTP messaging rules, so a field the library would drop silently
reaches the validator, which answers 400).

Where each piece is: ``_ffi`` (the declarations, and loading the system
library in cffi's ABI mode: no compiler needed), ``_shim`` (the C shim,
built on first use), ``_library`` (which of the two is in use, its
constants and errors), ``_codec`` (:class:`NgCodec`), ``_scan`` (each
read's frame headers checked before the library sees them), ``_reports``
(what the library parsed, as the contract's events), ``_headers``
(header lists handed to the library), ``_events`` (the event classes).
``MODE`` and ``SHIM_REASON`` say how the library is reached.

:func:`make_nghttp2` takes what ``make_h2`` takes. Importing this package
raises ``ImportError`` with a one-line reason where libnghttp2 cannot be
loaded; :func:`blocks.transport._codec.use_codec` turns that into the
choice of hyper-h2 (``auto``) or a clear error (``nghttp2``).
"""

from __future__ import annotations

from blocks.transport._codec import GuardedFrameBuffer
from blocks.transport._nghttp2._codec import NgCodec
from blocks.transport._nghttp2._library import MODE, SHIM_REASON, NgProtocolError, NgStreamClosedError

__all__ = ["MODE", "SHIM_REASON", "NgCodec", "NgProtocolError", "NgStreamClosedError", "make_nghttp2"]

_HEADER_TABLE_SIZE = 1
_MAX_CONCURRENT_STREAMS = 3
_INITIAL_WINDOW_SIZE = 4
_MAX_FRAME_SIZE = 5
_MAX_HEADER_LIST_SIZE = 6
_ENABLE_PUSH = 2
_ENABLE_CONNECT_PROTOCOL = 8


def make_nghttp2(
    *,
    client_side: bool,
    max_concurrent_streams: int,
    stream_window: int,
    max_header_list_size: int,
    header_list_cap: int | None = None,
    count_streams: bool = True,
    huffman: bool = False,
    guard: GuardedFrameBuffer | None = None,
    check_lengths: bool = True,
    connect_protocol: bool = False,
    outlive_goaway: bool = False,
) -> NgCodec:
    """The nghttp2 codec for one side of one hop: ``make_h2``'s arguments, with these differences.

    ``huffman``: the library picks, per literal, the shorter of Huffman and
    plain (in C either costs next to nothing). ``check_lengths``: the library
    checks no ``content-length`` (its HTTP messaging is off); a validating
    listener checks a request's itself, as with hyper-h2, and between hops a
    body shorter or longer than declared is relayed as it is.
    ``outlive_goaway``: a session always lets the streams under a GOAWAY's
    last id finish.
    """
    settings = [
        (_MAX_CONCURRENT_STREAMS, max_concurrent_streams),  # first: see NgCodec._patch
        (_INITIAL_WINDOW_SIZE, stream_window),
        (_MAX_HEADER_LIST_SIZE, max_header_list_size),
        (_ENABLE_PUSH, 0),
        # (the library's values, sent as hyper-h2 sends them: a peer reads every limit in the first SETTINGS)
        (_HEADER_TABLE_SIZE, 4096),
        (_MAX_FRAME_SIZE, 16384),
        (_ENABLE_CONNECT_PROTOCOL, int(connect_protocol)),
    ]
    return NgCodec(
        client_side=client_side,
        settings=settings,
        header_list_cap=header_list_cap or max_header_list_size,
        count_streams=count_streams,
        guard=guard,
    )
