"""The WebSocket frame-boundary tracker, against frames wsproto builds, cut anywhere.

Rules: sans-IO, no sockets; hypothesis draws the frames (every opcode,
payloads around each length encoding: 125, 126, 65535, 65536 bytes,
masked as a client's or not as a server's, fragmented messages) and where
the reads cut the stream (inside headers, inside payloads, at boundaries).
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wsproto.frame_protocol import CloseReason, FrameProtocol, Opcode

from blocks.transport.streams import FrameTracker, close_frame

SIZES = st.one_of(
    st.integers(0, 10),
    st.sampled_from([124, 125, 126, 127, 65535, 65536, 65537]),
    st.integers(0, 70_000),
)


@st.composite
def streams(draw: st.DrawFn) -> tuple[bytes, list[int], list[bool], list[int]]:
    """Frames of one direction, as wsproto writes them: (stream, where each ends, is each a Close, read cuts)."""
    client = draw(st.booleans())  # a client masks its frames: the tracker must skip the 4-byte key too
    protocol = FrameProtocol(client=client, extensions=[])
    frames: list[bytes] = []
    closes: list[bool] = []
    message: str | None = None  # the kind of the fragmented message going on, if one is
    for _ in range(draw(st.integers(0, 8))):
        kind = draw(st.sampled_from(["text", "binary", "ping", "pong", "close"]))
        size = draw(SIZES)
        if kind in ("text", "binary"):
            kind = message or kind  # (a continuation keeps its message's kind)
            fin = draw(st.booleans())
            payload: bytes | str = "é" * (size // 2) if kind == "text" else b"x" * size
            frames.append(bytes(protocol.send_data(payload, fin=fin)))
            message = None if fin else kind
        elif kind == "close":
            frames.append(bytes(protocol.close(CloseReason.GOING_AWAY, "r" * min(size, 120))))
        else:
            payload = b"p" * min(size, 125)  # control frames carry at most 125 bytes
            frames.append(bytes(protocol.ping(payload) if kind == "ping" else protocol.pong(payload)))
        closes.append(kind == "close")
    stream = b"".join(frames)
    ends, at = [], 0
    for frame in frames:
        at += len(frame)
        ends.append(at)
    cuts = sorted(set(draw(st.lists(st.integers(0, len(stream)), max_size=40))))
    return stream, ends, closes, cuts


def chunks_of(stream: bytes, cuts: list[int]) -> list[bytes]:
    edges = [0, *cuts, len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(edges) if b > a]


@settings(max_examples=300, deadline=None)
@given(streams())
def test_feed_knows_after_every_read_whether_the_stream_stands_at_a_frame_boundary(
    drawn: tuple[bytes, list[int], list[bool], list[int]],
) -> None:
    stream, ends, closes, cuts = drawn
    tracker = FrameTracker()
    assert tracker.at_boundary
    boundaries = {0, *ends}
    position = 0
    for chunk in chunks_of(stream, cuts):
        tracker.feed(chunk)
        position += len(chunk)
        assert tracker.at_boundary == (position in boundaries), (position, tracker)
        assert tracker.frames >= sum(end <= position for end in ends)  # frames wholly past: their headers went by
    assert tracker.frames == len(ends)
    assert tracker.closed == any(closes)


@settings(max_examples=300, deadline=None)
@given(streams(), st.data())
def test_until_boundary_stops_at_the_first_frame_end_in_a_chunk_and_never_past_it(
    drawn: tuple[bytes, list[int], list[bool], list[int]], data: st.DataObject
) -> None:
    stream, ends, _, cuts = drawn
    tracker = FrameTracker()
    position = 0
    for chunk in chunks_of(stream, cuts):
        offset = 0
        while offset < len(chunk):
            if data.draw(st.booleans(), label="feed whole"):
                tracker.feed(chunk[offset:])
                position += len(chunk) - offset
                break
            at = tracker.until_boundary(chunk[offset:])
            following = [end for end in ends if end > position]
            if at < 0:
                # no frame ends within what was left of the chunk
                assert not following or following[0] > position + len(chunk) - offset
                position += len(chunk) - offset
                break
            assert at > 0
            position += at
            offset += at
            assert position == following[0]  # the first frame end, not a later one
            assert tracker.at_boundary
    assert position == len(stream)
    assert tracker.at_boundary


def test_a_header_cut_after_each_of_its_bytes_is_put_together() -> None:
    frame = bytes(FrameProtocol(client=True, extensions=[]).send_data(b"z" * 70_000))  # 2 + 8 + 4 header bytes
    for cut in range(1, 14):
        tracker = FrameTracker()
        tracker.feed(frame[:cut])
        assert not tracker.at_boundary and tracker.frames == 0
        assert tracker.until_boundary(frame[cut:]) == len(frame) - cut
        assert tracker.frames == 1


def test_close_frame_is_what_wsproto_reads_as_that_code_and_reason() -> None:
    frame = close_frame(1001, "session ended: drained")
    reader = FrameProtocol(client=True, extensions=[])  # a client reads a server's (unmasked) frames
    reader.receive_bytes(frame)
    (received,) = list(reader.received_frames())
    assert received.opcode is Opcode.CLOSE
    assert received.payload == (CloseReason.GOING_AWAY, "session ended: drained")
    with pytest.raises(ValueError, match="at most 123 bytes"):
        close_frame(1001, "x" * 124)
