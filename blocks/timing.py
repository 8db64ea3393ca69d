"""Server-Timing: where the time of one request went, hop by hop.

Every hop measures its own time and appends entries to the response's one
``server-timing`` header as the response head passes through it on the way
back, so the client sees the whole chain in a single header:

    server-timing: app;dur=0.41, worker;dur=0.12, proxy-route;dur=0.01,
                   proxy;dur=0.15, edge;dur=0.14, total;dur=1.02

Phase names (durations in milliseconds, measured up to the response head):

``app``          the worker's wait for the replica's response head.
``worker``       the worker's own time: its total minus ``app``.
``proxy-route``  the proxy's route lookup and replica pick.
``proxy``        the proxy's own time, ``proxy-route`` included, its wait
                 for the worker excluded.
``edge``         the edge's own time, its wait for the proxy excluded.
``total``        the edge's whole time, from the request head to the
                 response head: everything above plus the hops' transport.

A hop's own time is its total minus its wait for the next hop, so
``edge + proxy + worker + app <= total``, and within a hop the sub-phases
(``proxy-route``) never exceed the hop's own entry.
"""

from __future__ import annotations

from time import perf_counter

from hpack import NeverIndexedHeaderTuple

from blocks._common import Headers

SERVER_TIMING = b"server-timing"


class Timing:
    """The clock of one request at one hop.

    Created when the request head arrives. ``phase(name, seconds)`` records a
    sub-phase, the hop sets ``upstream`` to its wait for the next hop when the
    response head arrives, and ``entries(hop)`` renders this hop's part of
    the header.
    """

    __slots__ = ("_phases", "start", "upstream")

    def __init__(self, start: float | None = None) -> None:
        self.start = perf_counter() if start is None else start
        self.upstream = 0.0
        self._phases: list[tuple[str, float]] = []

    def phase(self, name: str, seconds: float) -> None:
        self._phases.append((name, seconds))

    @property
    def phases(self) -> list[tuple[str, float]]:
        """The sub-phases recorded so far, ``(name, seconds)`` in order (read them, do not edit)."""
        return self._phases

    def entries(self, hop: str, *, upstream_name: str | None = None, total: bool = False) -> bytes:
        """This hop's Server-Timing entries, as of now.

        ``upstream_name`` names the wait for the next hop as a phase of its own
        (the worker reports it as ``app``); ``total`` adds a ``total`` entry
        (the outermost hop does).
        """
        elapsed = perf_counter() - self.start
        parts = [f"{name};dur={seconds * 1000:.3f}" for name, seconds in self._phases]
        if upstream_name is not None:
            parts.insert(0, f"{upstream_name};dur={self.upstream * 1000:.3f}")
        parts.append(f"{hop};dur={(elapsed - self.upstream) * 1000:.3f}")
        if total:
            parts.append(f"total;dur={elapsed * 1000:.3f}")
        return ", ".join(parts).encode()


def add_server_timing(headers: Headers, entries: bytes) -> Headers:
    """Append ``entries`` to the one ``server-timing`` field, creating it if needed.

    Several ``server-timing`` fields from upstream are folded into one.
    Returns a new list; ``headers`` is not changed.
    """
    merged: list[bytes] = []
    rest: Headers = []
    for name, value in headers:
        if name == SERVER_TIMING:
            merged.append(value)
        else:
            rest.append((name, value))
    merged.append(entries)
    # Never indexed: the value differs on every response, and indexing it
    # would only evict useful entries from both peers' HPACK tables.
    rest.append(NeverIndexedHeaderTuple(SERVER_TIMING, b", ".join(merged)))
    return rest


def parse_server_timing(value: str | bytes) -> dict[str, float]:
    """``{name: dur_ms}`` from a ``server-timing`` value (tests and tools)."""
    if isinstance(value, bytes):
        value = value.decode()
    out: dict[str, float] = {}
    for entry in value.split(","):
        name, _, params = entry.strip().partition(";")
        for param in params.split(";"):
            key, _, raw = param.strip().partition("=")
            if key == "dur":
                out[name] = float(raw)
    return out


__all__ = [
    "SERVER_TIMING",
    "Timing",
    "add_server_timing",
    "parse_server_timing",
]
