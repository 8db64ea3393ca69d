"""The private parts of h2 that proxyblocks relies on are still there, and still mean what they meant.

``pyproject.toml`` pins h2 to the minor release these were checked against.
When a new h2 changes one of them, this test says which and where it is
used, instead of the chain failing in some stranger way.
"""

from __future__ import annotations

import inspect

import h2
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.frame_buffer
import h2.settings
import h2.stream
import h2.windows
import hpack
import hyperframe.frame
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from blocks.transport._codec import MAX_CONTINUATIONS, CompactSettings, GuardedFrameBuffer, H2Codec, make_h2
from blocks.transport._h2 import H2Driver, acknowledge


def relied_on(owner: object, name: str, where: str) -> object:
    value = getattr(owner, name, None)
    if value is None:
        pytest.fail(f"h2 {h2.__version__} has no {getattr(owner, '__name__', owner)}.{name}, which {where} relies on")
    return value


def test_the_connection_state_machine_table_outlived_goaway() -> None:
    machine = h2.connection.H2ConnectionStateMachine
    table = relied_on(machine, "_transitions", "blocks/transport/_codec/_h2codec.py (_OUTLIVE_GOAWAY)")
    assert isinstance(table, dict)
    key = (h2.connection.ConnectionState.CLIENT_OPEN, h2.connection.ConnectionInputs.RECV_GOAWAY)
    assert key in table, "the pool rewrites this transition so that a GOAWAY leaves the connection open"
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    assert conn.state_machine._transitions is table, "each connection's state machine reads the class table"


def test_new_streams_are_made_by_one_method_with_the_content_length_checks_as_methods() -> None:
    begin = relied_on(
        h2.connection.H2Connection, "_begin_new_stream", "blocks/transport/_codec/_h2codec.py (_LengthUncheckedCodec)"
    )
    assert callable(begin)
    assert list(inspect.signature(begin).parameters) == ["self", "stream_id", "allowed_ids"]
    for name in ("_initialize_content_length", "_track_content_length"):
        relied_on(h2.stream.H2Stream, name, "blocks/transport/_codec/_stream.py (_LengthUncheckedStream)")
    assert not hasattr(h2.stream.H2Stream, "__slots__") or "__dict__" in h2.stream.H2Stream.__slots__, (
        "_LengthUncheckedStream swaps __class__ on h2's streams: they must share a layout"
    )


def test_the_frame_buffer_still_buffers_in_data_and_parses_headers_in_one_method() -> None:
    relied_on(
        h2.frame_buffer.FrameBuffer, "_update_header_buffer", "blocks/transport/_codec/_guard.py (GuardedFrameBuffer)"
    )
    guard = GuardedFrameBuffer(max_header_block=1024, max_empty=8, flood_limit=10, flood_window=1.0)
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    guard.add_data(preface + b"\x00\x00\x00")
    assert bytes(guard._data) == b"\x00\x00\x00", "GuardedFrameBuffer reads the frame header from _data"


@pytest.mark.codec("h2")  # (h2's inbound WindowManager, where H2Codec.inbound_books reads its books)
def test_the_inbound_window_books_are_where_statistics_read_them() -> None:
    server = make_h2(client_side=False, max_concurrent_streams=10, stream_window=65535, max_header_list_size=65536)
    window = relied_on(
        server, "_inbound_flow_control_window_manager", "H2Codec.inbound_books in transport/_codec/_h2codec.py"
    )
    assert isinstance(window, h2.windows.WindowManager)
    for name in ("max_window_size", "current_window_size", "_bytes_processed"):
        assert isinstance(getattr(window, name, None), int), f"WindowManager.{name} (H2Codec.inbound_books)"
    # And they mean what the statistics make of them: 1000 bytes held, then none.
    driver = H2Driver(trio.testing.memory_stream_pair()[0], server, connection_window=1 << 24)
    driver.start()
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.send_headers(1, [(":method", "POST"), (":scheme", "http"), (":authority", "a"), (":path", "/")])
    client.send_data(1, b"x" * 1000)
    server.receive_data(client.data_to_send())
    assert driver.statistics().unacknowledged == 1000
    acknowledge(server, 1000, 1)
    assert driver.statistics().unacknowledged == 0


@pytest.mark.codec("h2")  # (h2's connection state machine, which H2Codec.reopen_after_goaway writes)
def test_the_connection_state_is_where_reopen_after_goaway_writes_it() -> None:
    for side in (True, False):
        codec = make_h2(client_side=side, max_concurrent_streams=10, stream_window=65535, max_header_list_size=65536)
        relied_on(codec.state_machine, "state", "blocks/transport/_codec/_h2codec.py (H2Codec.reopen_after_goaway)")
        codec.initiate_connection()
        codec.receive_data(
            (b"" if side else b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # SETTINGS
            + b"\x00\x00\x08\x07\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"  # GOAWAY(0, NO_ERROR)
        )
        assert codec.state_machine.state is h2.connection.ConnectionState.CLOSED, "h2 closes on a GOAWAY received"
        codec.reopen_after_goaway()
        opened = h2.connection.ConnectionState.CLIENT_OPEN if side else h2.connection.ConnectionState.SERVER_OPEN
        assert codec.state_machine.state is opened


@pytest.mark.codec("h2")  # (H2Codec's outliving state machine and h2's PingReceived event)
def test_the_outliving_state_machine_takes_the_frames_behind_a_goaway() -> None:
    codec = make_h2(
        client_side=True,
        outlive_goaway=True,
        max_concurrent_streams=10,
        stream_window=65535,
        max_header_list_size=65536,
    )
    assert isinstance(codec, H2Codec)
    codec.initiate_connection()
    codec.send_headers(1, [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"a"), (b":path", b"/")])
    events = codec.receive_data(
        b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # SETTINGS
        + b"\x00\x00\x08\x07\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"  # GOAWAY(0, NO_ERROR)
        + b"\x00\x00\x08\x06\x00\x00\x00\x00\x00pingping"  # PING, behind it
    )
    assert [type(ev).__name__ for ev in events][-2:] == ["ConnectionTerminated", "PingReceived"]


def test_every_event_the_drivers_handle_is_mapped_to_its_kind() -> None:
    import h2.events

    kinds = H2Codec.event_kinds
    assert all(isinstance(cls, type) and issubclass(cls, h2.events.Event) for cls in kinds)
    assert len(set(kinds.values())) == len(kinds), "one h2 event class per kind"


def _client_frames(*blocks: tuple[int, list[tuple[bytes, bytes]], bool]) -> bytes:
    """A client's preface, then one HEADERS frame per ``(stream, fields, END_STREAM)``, as sent: unchecked."""
    encoder = hpack.Encoder()
    data = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + hyperframe.frame.SettingsFrame(0).serialize()
    for sid, fields, end in blocks:
        flags = ["END_HEADERS", "END_STREAM"] if end else ["END_HEADERS"]
        data += hyperframe.frame.HeadersFrame(sid, encoder.encode(fields), flags=flags).serialize()
    return data


# (h2's own connection errors, which _stream.py patches; h2's event classes; the :status H2Codec empties for h2)
@pytest.mark.codec("h2")
def test_a_malformed_requests_headers_frame_is_its_streams_error_on_a_validating_server() -> None:
    where = "blocks/transport/_codec/_stream.py (_LengthUncheckedStream.receive_headers)"
    receive = relied_on(h2.stream.H2Stream, "receive_headers", where)
    assert list(inspect.signature(receive).parameters) == ["self", "headers", "end_stream", "header_encoding"]
    machine = h2.stream.H2StreamStateMachine(1)
    assert machine.state is h2.stream.StreamState.IDLE and not machine.headers_received, where
    limits = {"max_concurrent_streams": 10, "stream_window": 65535, "max_header_list_size": 65536}
    head = [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"a"), (b":path", b"/")]
    malformed = {
        "trailers without END_STREAM": [(1, head, False), (1, [(b"x-trailer", b"1")], False)],
        "trailers h2 takes for an informational response": [(1, head, False), (1, [(b":status", b"103")], False)],
        "a head h2 takes for an informational response": [(1, [(b":status", b"100"), *head], True)],
    }
    # What the patch is for: h2 makes each of these a connection error.
    for what, blocks in malformed.items():
        with pytest.raises(h2.exceptions.ProtocolError):
            make_h2(client_side=False, **limits).receive_data(_client_frames(*blocks))
            pytest.fail(f"h2 {h2.__version__} no longer fails the connection for {what}")
    # What it makes of them on a validating server's connection: events of the stream, the stream left
    # open (a 400 can go, then the reset), the connection going on.
    codec = make_h2(client_side=False, check_lengths=False, **limits)
    codec.initiate_connection()
    events = codec.receive_data(
        _client_frames(
            (1, head, False),
            (1, [(b"x-trailer", b"1")], False),
            (3, head, False),
            (3, [(b":status", b"103")], False),
            (5, [(b":status", b"100"), *head], True),
            (7, head, True),
        )
    )
    kinds = [(type(ev).__name__, ev.stream_id) for ev in events if hasattr(ev, "stream_id")]
    assert kinds == [
        ("RequestReceived", 1),
        ("TrailersReceived", 1),
        ("RequestReceived", 3),
        ("TrailersReceived", 3),
        ("RequestReceived", 5),
        ("StreamEnded", 5),
        ("RequestReceived", 7),
        ("StreamEnded", 7),
    ], kinds
    trailers = [ev for ev in events if isinstance(ev, h2.events.TrailersReceived)]
    assert [(ev.headers, ev.stream_ended) for ev in trailers] == [
        ([(b"x-trailer", b"1")], None),
        ([(b":status", b"103")], None),
    ]
    request = next(ev for ev in events if isinstance(ev, h2.events.RequestReceived) and ev.stream_id == 5)
    assert request.headers[0] == (b":status", b""), "a :status that h2 would take for a 1xx is emptied"
    for sid in (1, 3, 5):
        codec.send_headers(sid, [(b":status", b"400")])
        codec.send_data(sid, b"why")
        codec.reset_stream(sid, h2.errors.ErrorCodes.PROTOCOL_ERROR)
    assert not any(codec.stream_is_open(sid) for sid in (1, 3, 5))
    assert codec.stream_is_open(7)
    # A HEADERS frame on a stream whose remote side has ended stays h2's own stream error (STREAM_CLOSED).
    block = hpack.Encoder().encode([(b"x", b"1")])
    events = codec.receive_data(hyperframe.frame.HeadersFrame(7, block, flags=["END_HEADERS"]).serialize())
    assert [(type(ev).__name__, ev.error_code) for ev in events] == [
        ("StreamReset", h2.errors.ErrorCodes.STREAM_CLOSED)
    ]
    sent = memoryview(codec.data_to_send())
    kinds = []
    while sent:
        frame, length = hyperframe.frame.Frame.parse_frame_header(sent[:9])
        frame.parse_body(sent[9 : 9 + length])
        sent = sent[9 + length :]
        kinds.append((type(frame).__name__, frame.stream_id))
    assert ("GoAwayFrame", 0) not in kinds, kinds
    assert [kind for kind in kinds if kind[0] == "RstStreamFrame"] == [
        ("RstStreamFrame", 1),
        ("RstStreamFrame", 3),
        ("RstStreamFrame", 5),
        ("RstStreamFrame", 7),
    ]


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def test_the_frame_buffer_checks_a_length_only_once_the_whole_frame_is_in() -> None:
    # GuardedFrameBuffer.__next__ refuses an oversized frame from its header, on the StopIteration h2
    # raises for a frame not all in; h2 itself would wait for all 16 MiB.
    announced = (2**24 - 1).to_bytes(3) + b"\x00\x00\x00\x00\x00\x01"  # DATA, stream 1, no payload yet
    plain = h2.frame_buffer.FrameBuffer(server=False)
    plain.max_frame_size = 16384
    plain.add_data(announced)
    with pytest.raises(StopIteration):
        next(plain)
    guard = GuardedFrameBuffer(max_header_block=1024, max_empty=8, flood_limit=10, flood_window=1.0)
    guard.max_frame_size = 16384
    guard.add_data(PREFACE + SETTINGS + announced)
    next(guard)  # the SETTINGS
    with pytest.raises(h2.exceptions.FrameTooLargeError):
        next(guard)


@pytest.mark.parametrize("continuations", [MAX_CONTINUATIONS, MAX_CONTINUATIONS + 1])
def test_h2_takes_a_header_block_in_max_continuations_frames_and_no_more(continuations: int) -> None:
    relied_on(h2.frame_buffer, "CONTINUATION_BACKLOG", "blocks/transport/_codec/_guard.py (MAX_CONTINUATIONS)")
    plain = h2.frame_buffer.FrameBuffer(server=False)
    plain.max_frame_size = 16384
    frames: list[hyperframe.frame.Frame] = [hyperframe.frame.HeadersFrame(1, b"\x82")]
    frames += [hyperframe.frame.ContinuationFrame(1, b"\x84") for _ in range(continuations)]
    frames[-1].flags.add("END_HEADERS")
    plain.add_data(b"".join(f.serialize() for f in frames))
    if continuations > MAX_CONTINUATIONS:
        with pytest.raises(h2.exceptions.ProtocolError):
            next(plain)  # h2's PROTOCOL_ERROR, which GuardedFrameBuffer turns into ENHANCE_YOUR_CALM first
    else:
        block = next(plain)
        assert isinstance(block, hyperframe.frame.HeadersFrame)
        assert block.data == b"\x82" + b"\x84" * continuations


@pytest.mark.parametrize("count_streams", [True, False])
@pytest.mark.codec("h2")  # (h2's source, its TooManyStreamsError and local_settings)
def test_h2_refuses_streams_past_the_limit_it_reads_from_the_local_settings(count_streams: bool) -> None:
    source = inspect.getsource(h2.connection.H2Connection._receive_headers_frame)
    assert "self.local_settings.max_concurrent_streams" in source, (
        "make_h2(count_streams=False) hides the limit from h2 there (_StreamsUncountedSettings)"
    )
    codec = make_h2(
        client_side=False,
        max_concurrent_streams=1,
        stream_window=65535,
        max_header_list_size=65536,
        count_streams=count_streams,
    )
    codec.initiate_connection()
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    head = [(":method", "GET"), (":scheme", "http"), (":authority", "a"), (":path", "/")]
    client.send_headers(1, head)
    client.send_headers(3, head)
    if count_streams:
        with pytest.raises(h2.exceptions.TooManyStreamsError):
            codec.receive_data(client.data_to_send())
    else:
        events = codec.receive_data(client.data_to_send())
        assert [ev.stream_id for ev in events if isinstance(ev, h2.events.RequestReceived)] == [1, 3]
        assert codec.local_settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] == 1, "still advertised"


def test_closed_streams_are_recorded_where_the_codec_bounds_them() -> None:
    """h2 records how a stream closed in ``_closed_streams`` (item assignment only) when it sweeps
    ``streams``, and asks ``_stream_closed_by`` whether a late frame is a stream or a connection error."""
    closed_by = relied_on(h2.connection.H2Connection, "_stream_closed_by", "H2Codec in transport/_codec/_h2codec.py")
    assert callable(closed_by)
    assert list(inspect.signature(closed_by).parameters) == ["self", "stream_id"]
    for name in ("_stream_is_closed_by_reset", "_stream_is_closed_by_end", "_open_streams"):
        source = inspect.getsource(getattr(h2.connection.H2Connection, name))
        assert "_stream_closed_by" in source or "_closed_streams[stream_id] =" in source, name
    conn = make_h2(client_side=False, max_concurrent_streams=10, stream_window=65535, max_header_list_size=65536)
    assert type(conn._closed_streams).__name__ == "_ClosedStreams", "H2Codec.__init__ replaces h2's record"


_SETTING_VALUES = {
    h2.settings.SettingCodes.HEADER_TABLE_SIZE: st.integers(0, 65536),
    h2.settings.SettingCodes.ENABLE_PUSH: st.integers(0, 1),
    h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: st.integers(0, 1000),
    h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: st.integers(0, 2**31 - 1),
    h2.settings.SettingCodes.MAX_FRAME_SIZE: st.integers(16384, 2**24 - 1),
    h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: st.integers(0, 2**20),
    h2.settings.SettingCodes.ENABLE_CONNECT_PROTOCOL: st.integers(0, 1),
    0x99: st.integers(0, 2**32 - 1),  # unknown to h2: kept as received
}
_SETTING_OPS = st.lists(
    st.one_of(
        st.just(None),
        st.sampled_from(list(_SETTING_VALUES)).flatmap(lambda k: st.tuples(st.just(k), _SETTING_VALUES[k])),
    ),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(client=st.booleans(), ops=_SETTING_OPS)
def test_compact_settings_read_and_acknowledge_as_h2s_do(client: bool, ops: list[tuple[int, int] | None]) -> None:
    """``CompactSettings`` (lists where h2 keeps deques) is h2's ``Settings`` over any sequence of
    values set (sent or received) and acknowledgements: same values, same changes reported."""
    initial = {
        h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 100,
        h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 18,
    }
    ours, theirs = CompactSettings(client, initial), h2.settings.Settings(client, dict(initial))
    for op in ops:
        if op is None:
            changed = ours.acknowledge()
            expected = theirs.acknowledge()
            assert {k: (c.original_value, c.new_value) for k, c in changed.items()} == {
                k: (c.original_value, c.new_value) for k, c in expected.items()
            }
        else:
            ours[op[0]] = theirs[op[0]] = op[1]
        assert _values(ours) == _values(theirs)
        assert ours.max_concurrent_streams == theirs.max_concurrent_streams
        assert ours.max_header_list_size == theirs.max_header_list_size


def _values(settings: h2.settings.Settings) -> dict[int, int | None]:
    """Each setting's current value; None for one set and not yet acknowledged (h2 raises KeyError there)."""
    out: dict[int, int | None] = {}
    for key in list(settings):
        try:
            out[key] = settings[key]
        except KeyError:
            out[key] = None
    return out


@pytest.mark.codec("h2")  # (h2's stream and connection state tables and books, read by H2Codec's fast paths)
def test_the_data_fast_paths_read_what_h2_keeps_where_they_read_it() -> None:
    """``H2Codec.receive_data``, ``send_data`` and ``acknowledge_received_data`` (the token-stream fast paths)
    charge h2's own books and skip only transitions that leave a state as it was."""
    stream_machine = h2.stream.H2StreamStateMachine
    states, inputs = h2.stream.StreamState, h2.stream.StreamInputs
    table = h2.stream._transitions
    for state in (states.OPEN, states.HALF_CLOSED_LOCAL):
        func, after = table[(state, inputs.RECV_DATA)]
        assert after is state and func is stream_machine.data_received, "DATA received leaves the stream as it was"
    for state in (states.OPEN, states.HALF_CLOSED_REMOTE):
        assert table[(state, inputs.SEND_DATA)] == (None, state), "DATA sent leaves the stream as it was"
    connection = h2.connection.H2ConnectionStateMachine._transitions
    for state in (h2.connection.ConnectionState.CLIENT_OPEN, h2.connection.ConnectionState.SERVER_OPEN):
        for event in (h2.connection.ConnectionInputs.RECV_DATA, h2.connection.ConnectionInputs.SEND_DATA):
            assert connection[(state, event)] == (None, state)
    open_states = {s for s in states if h2.stream.STREAM_OPEN[s]}
    assert open_states == {states.OPEN, states.HALF_CLOSED_REMOTE, states.HALF_CLOSED_LOCAL}, "h2's stream.open"

    server = make_h2(client_side=False, max_concurrent_streams=10, stream_window=65535, max_header_list_size=65536)
    assert isinstance(server._data_to_send, bytearray)
    buffer = server.incoming_buffer
    assert isinstance(buffer._data, bytearray) and buffer._headers_buffer == []
    guard = GuardedFrameBuffer(max_header_block=1024, max_empty=8, flood_limit=10, flood_window=1.0)
    assert guard._first is True and guard._empty == 0
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.send_headers(1, [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"a"), (b":path", b"/")])
    server.receive_data(client.data_to_send())
    stream = server.streams[1]
    assert stream.state_machine.headers_received is True
    assert isinstance(stream._inbound_window_manager, h2.windows.WindowManager)
    assert isinstance(stream.outbound_flow_control_window, int)
    assert isinstance(server.outbound_flow_control_window, int)
    relied_on(stream, "_track_content_length", "H2Codec._data_run")
    assert stream._expected_content_length is None, "H2Codec._data_run: no declared length, nothing to count"
    for manager in (stream._inbound_window_manager, server._inbound_flow_control_window_manager):
        for name in ("current_window_size", "max_window_size", "_bytes_processed"):
            assert isinstance(getattr(manager, name), int), f"WindowManager.{name} (H2Codec.inbound_books)"
    relied_on(h2.connection.H2Connection, "_terminate_connection", "H2Codec.receive_data")
    relied_on(h2.connection.H2Connection, "_receive_frame", "H2Codec.receive_data")
