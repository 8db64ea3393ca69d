"""The server's and the client's scan of each read's frame headers, before the library sees them:
:class:`Scan`.

It keeps what the library leaves to its application: the server's abuse limits (the guard's
:meth:`~blocks.transport._codec.GuardedFrameBuffer.check`, which hyper-h2's frame buffer calls too),
and the RFC 9113 rules the library is lax or strict about, answered as hyper-h2 answers them. Where
an answer must be given at a point inside the read, the scan says where in :attr:`Scan.late`, and
the codec cuts the read there (``NgCodec._receive_answering_late``).
"""

from __future__ import annotations

from typing import Any

from blocks.transport._codec import CLOSED_STREAMS, ClosedStreams, ErrorCodes, GuardedFrameBuffer, ProtocolError
from blocks.transport._nghttp2._library import (
    END_STREAM,
    SETTINGS_MAX_FRAME_SIZE,
    NgProtocolError,
    ffi,
    lib,
    unpack_head,
)

LATE, CLOSE, ANSWER, SKIP = range(4)
"""What the codec does where :attr:`Scan.late` says (see ``NgCodec._receive_answering_late``)."""
_WITHHELD_MORE = 65536  # (a frame or header block withheld is at most this past the header-list cap)


class Scan:
    """One connection's scan state. ``heads``, ``opened`` and ``closed`` are the codec's own records
    (streams with a head received, a client's streams opened, streams closed), read here."""

    __slots__ = (
        "acks_due",
        "cap",
        "closed",
        "cut",
        "guard",
        "head",
        "heads",
        "last",
        "late",
        "new",
        "opened",
        "peer_ended",
        "peer_reset",
        "session",
        "skip",
    )

    def __init__(
        self,
        *,
        client_side: bool,
        guard: GuardedFrameBuffer | None,
        cap: int,
        session: Any,
        heads: set[int],
        opened: set[int],
        closed: ClosedStreams,
    ) -> None:
        self.guard = guard
        self.cap = cap
        self.session = session
        self.heads = heads
        self.opened = opened
        self.closed = closed
        self.skip = 0 if client_side else 24  # (guard) bytes of the frame being scanned still to come: the preface
        # a frame header cut by the end of a read (on a server, with what follows it: withheld from the library)
        self.head = b""
        # (guard) the stream of a DATA or HEADERS frame on an open stream that a read cut: hyper-h2 judges a frame
        # once it is whole, and the driver may reset its stream before then
        self.cut = 0
        self.last = 0  # (guard) the highest stream the client opened
        self.new: set[int] = set()  # (guard) the streams opened in the read being scanned
        self.peer_reset = ClosedStreams(CLOSED_STREAMS)  # (guard) streams the client reset
        self.peer_ended: set[int] = set()  # (guard) open streams the client ended: half-closed (remote)
        self.acks_due = 0 if client_side else 1  # (guard) SETTINGS ACKs due: for our one SETTINGS frame
        # what to do where in the read (a position, an action, a stream or, for SKIP, where the cut ends):
        # answer a late frame (at its end), reset a half-closed (remote) stream (at its frame's start) and
        # write the answer (at its end), cut a frame out
        self.late: list[tuple[int, int, int]] = []

    def server(self, data: bytes | bytearray) -> tuple[bytes | bytearray, int, ProtocolError | None]:
        """The guard's limits and :meth:`_stream_rules` over the frames in ``data`` (a server's):
        the bytes to feed (a frame withheld from the read before first, see below), how many of them may
        go to the session (actions where :attr:`late` says), and the error of the first frame past a limit.

        A frame header cut by the end of a read is withheld from the session until it is whole, and so
        is DATA or a header block on a stream already opened and not open for it (half-closed (remote),
        reset by the client, closed) until its end is in: it is answered (and the driver told) in the
        read that completes it, as hyper-h2, which acts on whole frames and header blocks, answers it.
        A SETTINGS ACK with none due (RFC 9113 6.5.3 makes it no error; the library fails the
        connection) is cut out."""
        guard = self.guard
        assert guard is not None
        head = self.head
        if head:
            data = head + data
            self.head = b""
        size = len(data)
        if not self.skip:  # (a HEADERS cut by a read opens its stream at the library once it is in)
            self.new.clear()
        pos = min(self.skip, size)
        self.skip -= pos
        if self.cut and not self.skip:  # (the frame a read cut on an open stream ends here)
            if self.cut not in self.heads:  # its stream was reset since: answered as the whole frame is
                self.late.append((pos, LATE, self.cut))
            self.cut = 0
        unpack = unpack_head
        heads = self.heads
        peer_reset = self.peer_reset
        ended = self.peer_ended
        new = self.new
        while pos + 9 <= size:
            high, low, kind, flags, sid = unpack(data, pos)
            length = high << 16 | low
            end = pos + 9 + length
            interrupted = False
            if (
                kind <= 1
                and sid <= self.last
                and ((sid not in heads and sid not in new) or sid in ended or sid in peer_reset)
            ):
                end, interrupted = _whole(data, sid, size, kind, flags, end)
                if end < 0:
                    if size - pos > self.cap + _WITHHELD_MORE or length > self.max_frame:
                        end = pos + 9 + length  # (past any header block the guard lets through: as it comes)
                    else:
                        self.head = bytes(data[pos:])
                        return data, pos, None
            ends = False
            carried = 0
            if kind <= 1 or kind == 9:
                carried = length
                if flags & 0x8 and kind != 9 and pos + 9 < size:  # PADDED (its length, when in)
                    carried -= 1 + data[pos + 9]
                if kind == 1 and flags & 0x20:  # PRIORITY
                    carried -= 5
                ends = bool((kind != 9 and flags & 0x1) or (kind and flags & 0x4))
            try:
                guard.check(kind, max(carried, 0), ends, bool(flags & 0x1) if kind in (4, 6) else False)
                if interrupted:  # (RFC 9113 6.10, found first, as hyper-h2 finds it before the stream's state)
                    raise NgProtocolError(f"a frame inside the header block of stream {sid & 0x7FFFFFFF}")
                if kind <= 3 and (kind or flags & 0x1 or sid not in heads or sid in peer_reset or sid in ended):
                    # (not DATA on an open stream, short of its last)
                    self._stream_rules(kind, flags, sid & 0x7FFFFFFF, pos, end, length, carried)
                elif kind == 4 and flags & 0x1 and not length and not sid:  # a SETTINGS ACK
                    if self.acks_due:
                        self.acks_due -= 1
                    else:
                        self.late.append((pos, SKIP, pos + 9))
            except ProtocolError as exc:
                return data, pos, exc
            pos += 9 + length
        if pos > size:
            self.skip = pos - size
            if kind <= 1 and sid in heads:
                self.cut = sid
            return data, size, None
        self.head = bytes(data[pos:])
        return data, pos, None

    @property
    def max_frame(self) -> int:
        """The largest frame we take (a larger one is the library's connection error)."""
        return int(lib.nghttp2_session_get_local_settings(self.session, SETTINGS_MAX_FRAME_SIZE))

    def _stream_rules(self, kind: int, flags: int, sid: int, start: int, end: int, length: int, carried: int) -> None:
        """What the library is lax or strict about, from a frame's header, answered as hyper-h2 answers
        it: RFC 9113 5.1.1 (a new stream's id above every one opened: else a connection error) and 5.1
        (a frame after the peer's RST_STREAM, DATA or HEADERS on a closed stream: the stream's error
        STREAM_CLOSED, HEADERS on a stream the peer had ended: the connection's; the library ignores
        them all; DATA or HEADERS on a half-closed (remote) stream: the stream's error STREAM_CLOSED,
        where the library fails the connection)."""
        if kind == 3:  # RST_STREAM
            self.peer_reset[sid] = True
            self.peer_ended.discard(sid)
            return
        if flags & 0x8 and carried < 0 and kind <= 1:  # (a connection error, found by hyper-h2 as it parses)
            raise NgProtocolError(f"padding past the end of a frame on stream {sid}")
        if kind == 2:  # PRIORITY: allowed on any stream
            return
        if sid in self.peer_reset:
            self.late.append((end, LATE, sid))
            return
        if not sid & 1:
            return
        if sid > self.last:
            if kind == 1:
                self.last = sid
                self.new.add(sid)
                if flags & END_STREAM:
                    self.peer_ended.add(sid)
            return  # (DATA on an idle stream: the library's connection error)
        if (
            sid in self.heads  # open (the common case, DATA on a stream whose request came)
            or sid in self.new
            or lib.nghttp2_session_find_stream(self.session, sid) != ffi.NULL  # (its header block still coming)
        ):
            if sid in self.peer_ended:
                if length > self.max_frame:
                    return  # (the library's connection error FRAME_SIZE_ERROR, as hyper-h2's)
                self.peer_ended.discard(sid)
                self.peer_reset[sid] = True  # (reset where the frame starts: a later frame is a late one)
                self.late += ((start, CLOSE, sid), (end, ANSWER, sid))
            elif flags & END_STREAM:
                self.peer_ended.add(sid)
            return
        closed = self.closed
        by_reset = closed.get(sid)
        if by_reset is None:
            if kind == 1 and sid > closed.forgotten[1]:
                raise NgProtocolError(f"stream {sid} opened after stream {self.last}")
            by_reset = True  # forgotten: taken for one we reset
        if kind == 1 and not by_reset:
            raise NgProtocolError(f"HEADERS on stream {sid}, which the client ended", ErrorCodes.STREAM_CLOSED)
        self.late.append((end, LATE, sid))

    def client(self, data: bytes | bytearray) -> tuple[int, ProtocolError | None]:
        """A client's scan of the frame headers in ``data``: DATA or HEADERS on a stream it closed and the
        library forgot (RFC 9113 5.1: the server sent them before our RST_STREAM reached it) is answered
        with RST_STREAM(STREAM_CLOSED), as hyper-h2 answers it; the library would ignore it. Only a
        HEADERS frame that opens no known response costs more than the loop."""
        head = self.head
        if head:
            data = head + data
        size = len(data)
        pos = min(self.skip, size)
        self.skip -= pos
        heads = self.heads
        opened = self.opened
        unpack = unpack_head
        while pos + 9 <= size:
            high, low, kind, _, sid = unpack(data, pos)
            length = high << 16 | low
            if kind <= 1 and sid not in heads and sid not in opened:
                try:
                    self._late_on_client(kind, sid & 0x7FFFFFFF, pos + 9 + length - len(head))
                except ProtocolError as exc:
                    self.head = b""
                    return max(pos - len(head), 0), exc
            pos += 9 + length
        if pos > size:
            self.skip = pos - size
            self.head = b""
        else:
            self.head = bytes(data[pos:])
        return size - len(head), None

    def _late_on_client(self, kind: int, sid: int, end: int) -> None:
        closed = self.closed
        by_reset = closed.get(sid)
        if by_reset is None:
            if not sid & 1 or sid > closed.forgotten[1]:
                return  # (on a stream never opened: the library's to answer)
            by_reset = True  # (a forgotten stream is taken for one we reset)
        if kind == 1 and not by_reset:
            # (h2's answer, a connection error: the library's would be to ignore the frame)
            raise NgProtocolError(f"HEADERS on stream {sid}, which has ended", ErrorCodes.STREAM_CLOSED)
        self.late.append((end, LATE, sid))


def _whole(data: bytes | bytearray, sid: int, size: int, kind: int, flags: int, end: int) -> tuple[int, bool]:
    """Where the DATA frame (``kind`` 0) or the header block (1) of stream ``sid`` ends in ``data`` (``end``:
    where its first frame ends), -1 if that is not in ``data`` yet; and whether another frame (or a
    CONTINUATION of another stream) interrupts the header block (a connection error: the block then
    ends with that frame)."""
    if kind == 1:
        while not flags & 0x4:  # (END_HEADERS)
            if end + 9 > size:
                return -1, False
            high, low, kind, flags, other = unpack_head(data, end)
            end += 9 + (high << 16 | low)
            if kind != 9 or other != sid:
                return (end if end <= size else -1), True
    return (end if end <= size else -1), False
