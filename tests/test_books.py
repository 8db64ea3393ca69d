"""The books of one hop, as a hypothesis state machine: no byte lost, duplicated or kept.

One hop, built from the real parts: a downstream :class:`H2ServerConnection`
(the listener's h2 side) whose relay splices each ``/splice`` request to an
upstream :class:`H2ClientConnection` of a real pool, or declines it so that
the handler path relays it (``pool.request``, the body pump, the response
body). Its two peers are plain ``h2`` connections the machine drives by
hand: a client and an upstream server. Bytes travel over in-memory streams,
so after each rule the machine waits until every task is blocked and the
exchange is still.

Rules interleave what real peers do to streams: request and response data
as the windows allow, END_STREAM, trailers-free ends, resets of every code
from either side, reads that give window back (or none: a peer that stops
reading), and early answers (END_STREAM then RST_STREAM(NO_ERROR)).

After every rule:

- no byte is lost, duplicated or reordered: what each peer received on a
  stream is a prefix of what the other sent on it, and a response the
  client saw end is whole;
- no connection of the hop gives back more bytes than it received (a byte
  acknowledged twice is caught even where h2 would clip the update);
- once the hop has no stream left, each of its connections holds no
  unacknowledged byte (``H2Driver.statistics().unacknowledged == 0``, and
  as many bytes given back as received): its window is full again.

The invariant is stated in docs/design-notes.md ("Every byte accounted").
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import hypothesis.strategies as st
import trio
import trio.testing
from hypothesis import HealthCheck, settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from blocks import ListenerConfig, Request, Response, UpstreamConfig
from blocks.transport._codec import EventKind
from blocks.transport._h2server import H2ServerConnection
from blocks.transport.multiplexer._h2pool import H2ClientConnection, _H2Pool

CODES = [
    h2.errors.ErrorCodes.NO_ERROR,
    h2.errors.ErrorCodes.PROTOCOL_ERROR,
    h2.errors.ErrorCodes.INTERNAL_ERROR,
    h2.errors.ErrorCodes.CANCEL,
    h2.errors.ErrorCodes.REFUSED_STREAM,
]
CHUNK = 16384
# Small windows, so that a few chunks fill them; the peers' smaller than the hop's,
# so that the hop takes more than it can pass on, and holds it.
STREAM_WINDOW = 65535
PEER_WINDOW = 32768


@attrs.define(eq=False)
class PeerStream:
    """One stream as a peer sees it."""

    sid: int
    sent: bytearray = attrs.field(factory=bytearray)  # DATA we sent on it
    received: bytearray = attrs.field(factory=bytearray)  # DATA it brought us
    unread: int = 0  # flow-controlled bytes received and not yet given back
    status: int = 0  # (client) the response's status; (server) the one we sent
    ended_local: bool = False
    ended_remote: bool = False
    reset: int | None = None  # the code it was reset with, by either side
    reset_remote: int | None = None  # the code of the RST_STREAM the other side sent, if it did
    reset_local: int | None = None  # the code of the RST_STREAM we sent, if we did
    early: bool = False  # (server) answered in full, then RST_STREAM(NO_ERROR)

    @property
    def open(self) -> bool:
        return self.reset is None and not (self.ended_local and self.ended_remote)


class Peer:
    """A plain h2 connection on one end of an in-memory stream, driven by the machine."""

    def __init__(self, stream: trio.abc.Stream, *, client: bool) -> None:
        self.stream = stream
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=client, header_encoding=None, validate_inbound_headers=False)
        )
        self.conn.local_settings = h2.settings.Settings(
            client=client, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: PEER_WINDOW}
        )
        self.streams: dict[int, PeerStream] = {}
        self.by_tag: dict[int, PeerStream] = {}  # (server) the request's x-n -> its stream

    async def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            await self.stream.send_all(data)

    async def reader(self) -> None:
        while data := await self.stream.receive_some(65536):
            for event in self.conn.receive_data(data):
                self.on_event(event)
            await self.flush()

    def stream_of(self, sid: int) -> PeerStream:
        if sid not in self.streams:
            self.streams[sid] = PeerStream(sid)
        return self.streams[sid]

    def on_event(self, event: h2.events.Event) -> None:
        sid = getattr(event, "stream_id", 0)
        if isinstance(event, h2.events.RequestReceived):
            ps = self.stream_of(sid)
            self.by_tag[int(dict(event.headers)[b"x-n"])] = ps
            ps.ended_remote = event.stream_ended is not None
        elif isinstance(event, h2.events.ResponseReceived):
            self.stream_of(sid).status = int(dict(event.headers)[b":status"])
        elif isinstance(event, h2.events.DataReceived):
            ps = self.stream_of(sid)
            ps.received += event.data
            ps.unread += event.flow_controlled_length
        elif isinstance(event, h2.events.StreamEnded):
            self.stream_of(sid).ended_remote = True
        elif isinstance(event, h2.events.StreamReset):
            ps = self.stream_of(sid)
            ps.reset_remote = event.error_code
            if ps.reset is None:
                ps.reset = event.error_code
            self.give_back(ps)

    def give_back(self, ps: PeerStream) -> None:
        """Read what came on ``ps``: its window goes back."""
        if ps.unread:
            self.conn.acknowledge_received_data(ps.unread, ps.sid)
            ps.unread = 0

    def send(self, ps: PeerStream, chunks: int, counter: Iterator[int]) -> None:
        """Send up to ``chunks`` chunks on ``ps`` as the windows allow, each unlike any other.

        Every third frame is padded (padding counts against the windows, and
        is acknowledged apart from the data it pads).
        """
        for _ in range(chunks):
            n = next(counter)
            data = n.to_bytes(4, "big") * ((CHUNK - 256) // 4)
            pad = (n * 37) % 256 if n % 3 == 0 else 0
            if not ps.open or ps.ended_local or self.conn.local_flow_control_window(ps.sid) < CHUNK:
                return
            self.conn.send_data(ps.sid, data, pad_length=pad or None)
            ps.sent += data

    def end(self, ps: PeerStream, trailers: bool) -> None:
        """END_STREAM on ``ps``: bare, or with trailers."""
        ps.ended_local = True
        if trailers:
            self.conn.send_headers(ps.sid, [(b"x-trailer", b"%d" % ps.sid)], end_stream=True)
        else:
            self.conn.end_stream(ps.sid)


@attrs.define
class Ledger:
    """Counts what h2's connection window manager of one connection saw: DATA received, and given back.

    h2 clips a window update that would open the window past its size, so
    a byte acknowledged twice could hide a byte never acknowledged; these
    counts cannot.
    """

    received: int = 0
    acknowledged: int = 0

    @classmethod
    def watch(cls, driver: Any) -> Ledger:
        ledger = cls()
        if not hasattr(driver.h2, "_inbound_flow_control_window_manager"):
            return cls._watch_contract(driver.h2, ledger)
        window = driver.h2._inbound_flow_control_window_manager
        consumed, processed = window.window_consumed, window.process_bytes

        def window_consumed(size: int) -> Any:
            ledger.received += size
            return consumed(size)

        def process_bytes(size: int) -> Any:
            ledger.acknowledged += size
            return processed(size)

        window.window_consumed, window.process_bytes = window_consumed, process_bytes
        return ledger

    @staticmethod
    def _watch_contract(codec: Any, ledger: Ledger) -> Ledger:
        """A codec without h2's window manager (libnghttp2's): counted at the contract, the DATA its
        events report and the bytes the driver gives back (the library clips an over-acknowledgement
        too, so these counts are the ones that catch it)."""
        receive, acknowledge = codec.receive_data, codec.acknowledge_received_data
        kinds = codec.event_kinds

        def receive_data(data: bytes) -> Any:
            evs = receive(data)
            for ev in evs:
                if kinds.get(type(ev)) is EventKind.DATA:
                    ledger.received += ev.flow_controlled_length
            return evs

        def acknowledge_received_data(size: int, sid: int) -> Any:
            if size > 0:
                ledger.acknowledged += size
            return acknowledge(size, sid)

        codec.receive_data, codec.acknowledge_received_data = receive_data, acknowledge_received_data
        return ledger


class HopBooks(RuleBasedStateMachine):
    """Rules over a hop's exchanges; see the module docstring."""

    exchanges = Bundle("exchanges")

    def __init__(self) -> None:
        super().__init__()
        self.counter = itertools.count()
        self.scope = trio.CancelScope()
        trio.from_thread.run(NURSERY[0].start, self._run)

    # -- plumbing: each rule runs in the test's trio run, then waits until all is still --------

    def act(self, mutate: Callable[[], object]) -> None:
        async def step() -> None:
            mutate()
            await self.client.flush()
            await self.server.flush()
            await trio.testing.wait_all_tasks_blocked()

        trio.from_thread.run(step)

    async def _run(self, task_status: trio.TaskStatus[None]) -> None:
        with self.scope:
            async with trio.open_nursery() as nursery:
                down_client, down_hop = trio.testing.memory_stream_pair()
                up_hop, up_server = trio.testing.memory_stream_pair()
                self.client = Peer(down_client, client=True)
                self.server = Peer(up_server, client=False)
                pool = _H2Pool(("127.0.0.1", 9), UpstreamConfig(stream_window=STREAM_WINDOW), nursery)
                self.up = H2ClientConnection(up_hop, pool)

                async def handler(request: Request) -> Response:
                    return await pool.request(request, request.headers, 600.0)

                def relay(request: Request, driver: Any, stream: Any, ended: bool) -> bool:
                    if request.path != b"/splice":
                        return False  # the handler path
                    return pool.splice(request, request.headers, driver, stream, ended, None, None)

                config = ListenerConfig(validate=False, stream_window=STREAM_WINDOW, max_client_resets=None)
                self.down = H2ServerConnection(down_hop, handler, config, client="client", scheme=b"http", relay=relay)
                self.ledgers = {"client's": Ledger.watch(self.down), "upstream": Ledger.watch(self.up)}
                self.server.conn.initiate_connection()
                await self.server.flush()
                nursery.start_soon(self.server.reader)
                await nursery.start(self.up.run)
                pool.connections.append(self.up)
                self.client.conn.initiate_connection()
                await self.client.flush()
                nursery.start_soon(self.client.reader)
                nursery.start_soon(self.down.run, b"")
                await trio.testing.wait_all_tasks_blocked()
                task_status.started()

    def upstream(self, sid: int) -> PeerStream | None:
        """The server's side of the client's stream ``sid``, once its request came."""
        return self.server.by_tag.get(sid)

    # -- rules: the client --------------------------------------------------------------------

    @rule(target=exchanges, path=st.sampled_from([b"/splice", b"/task"]), chunks=st.integers(-1, 6))
    def open(self, path: bytes, chunks: int) -> int:
        """A request: without a body (``chunks`` -1), or with ``chunks`` chunks of it so far."""
        sid = self.client.conn.get_next_available_stream_id()

        def mutate() -> None:
            head = [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"hop"), (b":path", path)]
            self.client.conn.send_headers(sid, [*head, (b"x-n", b"%d" % sid)], end_stream=chunks < 0)
            ps = self.client.stream_of(sid)
            ps.ended_local = chunks < 0
            self.client.send(ps, chunks, self.counter)

        self.act(mutate)
        return sid

    @rule(sid=exchanges, chunks=st.integers(1, 6), end=st.sampled_from(["", "end", "trailers"]))
    def client_sends(self, sid: int, chunks: int, end: str) -> None:
        """Up to ``chunks`` chunks of the request body, as the windows allow; then, with ``end``, its end."""
        ps = self.client.streams[sid]

        def mutate() -> None:
            self.client.send(ps, chunks, self.counter)
            if end and ps.open and not ps.ended_local:
                self.client.end(ps, end == "trailers")

        self.act(mutate)

    @rule(sid=exchanges, trailers=st.booleans())
    def client_ends(self, sid: int, trailers: bool) -> None:
        ps = self.client.streams[sid]
        if ps.open and not ps.ended_local:
            self.act(lambda: self.client.end(ps, trailers))

    @rule(sid=exchanges, code=st.sampled_from(CODES))
    def client_resets(self, sid: int, code: int) -> None:
        ps = self.client.streams[sid]
        if ps.open:
            ps.reset = ps.reset_local = code
            self.act(lambda: (self.client.conn.reset_stream(sid, code), self.client.give_back(ps)))

    @rule(sid=exchanges)
    def client_reads(self, sid: int) -> None:
        self.act(lambda: self.client.give_back(self.client.streams[sid]))

    # -- rules: the upstream server -------------------------------------------------------------

    @rule(sid=exchanges, chunks=st.integers(-1, 6), early=st.booleans())
    def server_answers(self, sid: int, chunks: int, early: bool) -> None:
        """The response head: alone (``chunks`` -1), or with ``chunks`` chunks and its end (then maybe ``early``)."""
        ps = self.upstream(sid)
        if ps is None or ps.status or not ps.open:
            return
        ps.status = 200

        def mutate() -> None:
            self.server.conn.send_headers(ps.sid, [(b":status", b"200")], end_stream=chunks == 0)
            ps.ended_local = chunks == 0
            if chunks > 0:
                self.server.send(ps, chunks, self.counter)
                self.server.end(ps, trailers=chunks % 2 == 0)
            if chunks >= 0 and early and not ps.ended_remote:
                self._early(ps)

        self.act(mutate)

    def _early(self, ps: PeerStream) -> None:
        # It read what had come (a WINDOW_UPDATE), then refused the rest: both in one write.
        self.server.give_back(ps)
        self.server.conn.reset_stream(ps.sid, h2.errors.ErrorCodes.NO_ERROR)
        ps.reset = ps.reset_local = h2.errors.ErrorCodes.NO_ERROR
        ps.early = True

    @rule(sid=exchanges, chunks=st.integers(1, 6))
    def server_sends(self, sid: int, chunks: int) -> None:
        ps = self.upstream(sid)
        if ps is not None and ps.status:
            self.act(lambda: self.server.send(ps, chunks, self.counter))

    @rule(sid=exchanges, early=st.booleans())
    def server_ends(self, sid: int, early: bool) -> None:
        """END_STREAM on the response; ``early``: then RST_STREAM(NO_ERROR) if the request has not ended."""
        ps = self.upstream(sid)
        if ps is None or not ps.status or ps.ended_local or not ps.open:
            return
        ps.ended_local = True
        early = early and not ps.ended_remote

        def mutate() -> None:
            self.server.end(ps, trailers=False)
            if early:
                self._early(ps)

        self.act(mutate)

    @rule(sid=exchanges, code=st.sampled_from(CODES))
    def server_resets(self, sid: int, code: int) -> None:
        ps = self.upstream(sid)
        if ps is not None and ps.open:
            ps.reset = ps.reset_local = code
            self.act(lambda: (self.server.conn.reset_stream(ps.sid, code), self.server.give_back(ps)))

    @rule(sid=exchanges)
    def server_reads(self, sid: int) -> None:
        ps = self.upstream(sid)
        if ps is not None:
            self.act(lambda: self.server.give_back(ps))

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def no_byte_lost_duplicated_or_reordered(self) -> None:
        for sid, ours in self.client.streams.items():
            theirs = self.upstream(sid)
            if theirs is None:
                assert ours.status != 200 or not ours.received, f"stream {sid}: an answer from nowhere"
                continue
            assert ours.sent.startswith(theirs.received), f"stream {sid}: the request arrived altered"
            if ours.status == 200:  # (not an answer of the hop's own: 502, 503, 504)
                assert theirs.sent.startswith(ours.received), f"stream {sid}: the response arrived altered"
                if ours.ended_remote and ours.reset is None:
                    assert ours.received == theirs.sent, f"stream {sid}: the response ended short"
            if theirs.ended_remote and theirs.reset is None:
                assert theirs.received == ours.sent, f"stream {sid}: the request ended short"

    @invariant()
    def no_byte_acknowledged_twice(self) -> None:
        for name, ledger in self.ledgers.items():
            assert ledger.acknowledged <= ledger.received, f"the {name} connection gave back more than came: {ledger}"

    @invariant()
    def an_idle_hop_holds_nothing(self) -> None:
        down, up = self.down.statistics(), self.up.statistics()
        if down.streams == 0 and up.streams == 0:
            assert down.unacknowledged == 0, f"the client's connection holds bytes: {down}"
            assert up.unacknowledged == 0, f"the upstream connection holds bytes: {up}"
            for name, ledger in self.ledgers.items():
                assert ledger.acknowledged == ledger.received, f"the {name} connection's books: {ledger}"

    def teardown(self) -> None:
        try:
            # Both peers read everything until nothing moves: an early answer must then be whole.
            for _ in range(100):
                before = sum(len(ps.received) for ps in [*self.client.streams.values(), *self.server.streams.values()])
                self.act(lambda: [p.give_back(ps) for p in (self.client, self.server) for ps in p.streams.values()])
                after = sum(len(ps.received) for ps in [*self.client.streams.values(), *self.server.streams.values()])
                if after == before:
                    break
            for sid, ours in self.client.streams.items():
                theirs = self.upstream(sid)
                if theirs is not None and ours.ended_local and ours.reset_local is None and theirs.reset_local is None:
                    # A whole request that neither peer reset: the hop has no reason to cut either way.
                    assert theirs.reset_remote is None, f"stream {sid}: the hop reset the upstream's stream"
                    assert theirs.ended_remote and theirs.received == ours.sent, f"stream {sid}: the request, cut"
                    if theirs.ended_local:
                        assert ours.ended_remote and ours.received == theirs.sent, f"stream {sid}: response cut"
                        assert ours.reset_remote in (None, 0), f"stream {sid}: reset {ours.reset_remote}"
                if theirs is not None and theirs.early and ours.reset == ours.reset_remote:  # (we never reset it)
                    assert ours.ended_remote, f"stream {sid}: an early answer never ended downstream"
                    assert ours.reset in (None, h2.errors.ErrorCodes.NO_ERROR), f"stream {sid}: reset {ours.reset}"
                    assert ours.status == 200 and ours.received == theirs.sent, f"stream {sid}: an early answer, cut"
            # Then the client leaves every exchange it still has: the hop must be idle, its books balanced.
            for sid, ours in self.client.streams.items():
                if ours.open:
                    self.client_resets(sid, h2.errors.ErrorCodes.CANCEL)
            down, up = self.down.statistics(), self.up.statistics()
            assert down.streams == 0 and up.streams == 0, f"streams left: {down}, {up}"
            self.an_idle_hop_holds_nothing()
        finally:
            trio.from_thread.run_sync(self.scope.cancel)


NURSERY: list[trio.Nursery] = []


async def test_every_byte_received_is_acknowledged_once(nursery: trio.Nursery) -> None:
    NURSERY[:] = [nursery]
    machine_settings = settings(
        max_examples=300,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    with trio.fail_after(600):
        await trio.to_thread.run_sync(functools.partial(run_state_machine_as_test, HopBooks, settings=machine_settings))


def replay(steps: Callable[[HopBooks], object]) -> Callable[[], None]:
    """One exchange the machine once found, as a fixed sequence of its rules (with every check)."""

    def run() -> None:
        machine = HopBooks()
        try:
            steps(machine)
            machine.no_byte_lost_duplicated_or_reordered()
            machine.no_byte_acknowledged_twice()
        finally:
            machine.teardown()

    return run


async def test_a_whole_request_answered_before_it_is_read_still_arrives_whole(nursery: trio.Nursery) -> None:
    """The upstream answers in full before reading a request that has ended (no reset): the hop's body
    pump, held up by the upstream's window, must still deliver every byte of it after the answer."""
    NURSERY[:] = [nursery]

    def steps(machine: HopBooks) -> None:
        sid = machine.open(b"/task", 3)
        machine.client_sends(sid, 3, "end")
        machine.server_answers(sid, 0, False)

    with trio.fail_after(60):
        await trio.to_thread.run_sync(replay(steps))
