"""The errors every block raises.

One root, :class:`BlocksError`, carries the HTTP status it maps to, so a
listener can turn any failure of a handler into a clear response without
knowing which block raised it. Foreign exceptions (``OSError``, h2's and
h11's protocol errors) are translated once, where they cross into
proxyblocks, with ``raise ... from exc``.
"""

from __future__ import annotations

import enum
import math

from blocks import fields


class BlocksError(Exception):
    """Root of proxyblocks' errors.

    ``status`` is the HTTP status a listener answers with when this error
    escapes a handler before the response has started, with ``headers``
    added to that response (a 429's ``retry-after``). ``error_reason`` is why, as
    a token of :data:`REASONS`: a hop answers with
    ``proxyblocks-error: REASON; hop=NAME`` (``status`` given alone picks
    the reason that status usually means). The message is for logs and
    statistics; it is never written on the wire.
    """

    status: int = 500
    error_reason: str = "internal"
    headers: list[tuple[bytes, bytes]] = []  # noqa: RUF012  (read-only default; subclasses set their own)

    def __init__(self, message: str = "", *, status: int | None = None, error_reason: str | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status
            if error_reason is None:
                error_reason = status_reason(status)
        if error_reason is not None:
            self.error_reason = error_reason


REASONS: dict[str, str] = {
    "bad_request": "the request is malformed",
    "unauthorized": "no valid credentials for the app",
    "no_route": "no route for the authority",
    "no_replica": "no live replica for the app",
    "no_next_hop": "the hop knows no next hop to send to (an edge with no proxy)",
    "next_hop_unreachable": "the hop could not connect to its next hop (``next=`` says which); nothing was sent",
    "next_hop_refused": "the next hop refused the stream twice; nothing was processed",
    "replica_unreachable": "the worker could not connect to the replica (``replica=`` says which); nothing was sent",
    "replica_refused": "the replica refused the stream twice; nothing was processed",
    "replica_timeout": "the next hop did not answer in time",
    "upstream_reset": "the next hop reset the stream or broke the protocol before answering",
    "overloaded": "the tenant's queue is full, or its wait timed out",
    "cold_start_timeout": "the app had no replica, and none was ready within the cold-start timeout",
    "cold_start_full": "the app had no replica, and too many requests already waited for its cold start",
    "cold_start_failed": "the app had no replica, and its start failed (or is backed off after failures)",
    "session_lost": "the session's replica is gone or lost, or its worker no longer hosts it",
    "too_large": "the request body is over the limit",
    "not_allowed": "the method is not allowed here",
    "internal": "a hop failed handling the request",
}
"""Every ``proxyblocks-error`` reason, and what it means (docs/errors.md has the table with statuses)."""

RETRYABLE_REASONS = frozenset(
    {b"replica_unreachable", b"replica_refused", b"next_hop_unreachable", b"next_hop_refused"}
)
"""The reasons that say nothing of the request was processed: a hop may send it to another upstream."""

UPSTREAM_REASONS = frozenset(
    {
        "replica_unreachable",
        "replica_refused",
        "replica_timeout",
        "upstream_reset",
        "next_hop_unreachable",
        "next_hop_refused",
    }
)
"""The reasons of a hop's own failure with its upstream: its error field names that upstream."""

NEXT_HOP_REASONS = {"replica_unreachable": "next_hop_unreachable", "replica_refused": "next_hop_refused"}
"""What a hop that is not the last (the edge, the proxy) calls its upstream's unreachable or refusal."""

_STATUS_REASONS = {
    400: "bad_request",
    401: "unauthorized",
    405: "not_allowed",
    410: "session_lost",
    413: "too_large",
    501: "not_allowed",
    429: "overloaded",
    502: "upstream_reset",
    503: "overloaded",
    504: "replica_timeout",
}


def status_reason(status: int) -> str:
    """The reason an error ``status`` usually means (``bad_request`` for 400, ``overloaded`` for
    503...); else ``bad_request`` for a 4xx, ``internal`` for a 5xx."""
    return _STATUS_REASONS.get(status) or ("bad_request" if status < 500 else "internal")


def parse_error_field(value: bytes) -> tuple[bytes, bytes]:
    """A ``proxyblocks-error`` value's reason and the hop that answered it (``b""``: none named yet,
    a hop's own error on its way to :meth:`~blocks.hops.Hop.error_field`)."""
    reason, _, rest = value.partition(b";")
    return reason.strip(), rest.partition(b"hop=")[2].partition(b";")[0].strip()


def error_field(reason: str, hop: str) -> tuple[bytes, bytes]:
    """The ``proxyblocks-error`` field of an error answered at ``hop``: ``REASON; hop=NAME``."""
    return (fields.ERROR_HEADER, f"{reason}; hop={hop}".encode())


class HopFailed(BlocksError):
    """Code that a hop runs for one request (a policy, a hook, a feature) raised: 500.

    The exception itself was logged, with its traceback, where it was
    caught; only that request fails.
    """

    status = 500


class BadRequest(BlocksError):
    """The request is malformed: 400. Raised at the edge, before any upstream is touched."""

    status = 400
    error_reason = "bad_request"


class Unauthorized(BlocksError):
    """No valid credentials for what the request asks: 401, with ``www-authenticate: Bearer``.

    Raised at the proxy before the request is admitted, routed or sent
    anywhere (see :class:`blocks.ProxyAuth`). The body is the generic
    ``401 Unauthorized``; why (no token, which check failed) is in the
    message, for logs and statistics only.
    """

    status = 401
    error_reason = "unauthorized"
    headers = [(b"www-authenticate", b"Bearer")]  # noqa: RUF012  (read-only, like BlocksError.headers)


class NoRoute(BlocksError):
    """No route for the authority (``no_route``), or no live replica behind it (``no_replica``): 503 at once."""

    status = 503
    error_reason = "no_route"


class UpstreamConnectError(BlocksError):
    """The upstream refused or dropped the connection before answering: 502, ``replica_unreachable``.

    Nothing of the request reached the upstream: the proxy may send it to
    another replica (see docs/errors.md).
    """

    status = 502
    error_reason = "replica_unreachable"


class UpstreamProtocolError(BlocksError):
    """The upstream broke the protocol or reset the stream before a response: 502, ``upstream_reset``.

    With status 503, the upstream refused the stream twice, never
    processing it (RFC 9113 8.7): ``replica_refused``, safe to send elsewhere.
    """

    status = 502
    error_reason = "upstream_reset"

    def __init__(self, message: str = "", *, status: int | None = None, error_reason: str | None = None) -> None:
        super().__init__(message, status=status, error_reason=error_reason)
        if error_reason is None and self.status == 503:
            self.error_reason = "replica_refused"


class UpstreamTimeout(BlocksError):
    """The upstream did not answer within the configured timeout: 504."""

    status = 504
    error_reason = "replica_timeout"


class StreamReset(BlocksError):
    """The peer reset a stream whose body was being read or written.

    Raised by :meth:`blocks.Body.receive` and by sends on a stream that the
    other side abandoned. ``status`` only matters if it escapes before a
    response started (then 502: the body we were relaying broke).
    """

    status = 502
    error_reason = "upstream_reset"

    def __init__(self, message: str = "", *, status: int | None = None, code: int | None = None) -> None:
        super().__init__(message, status=status)
        self.code = code
        """The HTTP/2 error code of the peer's RST_STREAM, when that is what ended the stream."""


class PayloadTooLarge(StreamReset):
    """The request body is over the listener's ``max_request_body``: 413.

    Raised before any body byte is read when the declared length is over,
    and by the body's ``receive`` when a streamed body crosses the limit. It
    is a :class:`StreamReset` too: whoever relays the body treats it as an
    upload cut short, and the listener answers 413 if no response started.
    """

    status = 413
    error_reason = "too_large"


# -- the fair scheduler and sessions --------------------------------------------------------


def _retry_after_headers(retry_after: float) -> list[tuple[bytes, bytes]]:
    return [(b"retry-after", b"%d" % math.ceil(retry_after))]


class QueueFull(BlocksError):
    """The tenant's wait queue is full: 429, with ``retry-after``.

    ``retry_after`` is the tenant's ``TenantPolicy.retry_after`` in seconds;
    ``headers`` is the ``retry-after`` field to send with the 429 (whole
    seconds, rounded up).
    """

    status = 429
    error_reason = "overloaded"

    def __init__(self, message: str, *, tenant: str, retry_after: float) -> None:
        super().__init__(message)
        self.tenant = tenant
        self.retry_after = retry_after
        self.headers = _retry_after_headers(retry_after)


class QueueTimeout(BlocksError):
    """The request waited its tenant's whole ``queue_timeout`` without a slot: 503.

    Carries ``retry_after`` and ``headers`` like :class:`QueueFull`.
    """

    status = 503
    error_reason = "overloaded"

    def __init__(self, message: str, *, tenant: str, retry_after: float) -> None:
        super().__init__(message)
        self.tenant = tenant
        self.retry_after = retry_after
        self.headers = _retry_after_headers(retry_after)


class ColdStartTimeout(BlocksError):
    """A request for an app with no replica waited its whole ``cold_start_timeout`` for one: 503.

    The autoscaler's cold-start wait (:class:`~blocks.autoscaler.ColdStartGate`)
    raises it; ``retry-after`` says when to try again (the replica may be up by then).
    """

    status = 503
    error_reason = "cold_start_timeout"

    def __init__(self, message: str, *, app: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.app = app
        self.retry_after = retry_after
        self.headers = _retry_after_headers(retry_after)


class ColdStartFull(BlocksError):
    """A request for an app with no replica found ``max_waiting`` requests already waiting for its cold start: 503.

    Refused at once, with ``retry-after``: the wait for a cold start is a
    bounded queue, never an accidental one.
    """

    status = 503
    error_reason = "cold_start_full"

    def __init__(self, message: str, *, app: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.app = app
        self.retry_after = retry_after
        self.headers = _retry_after_headers(retry_after)


class ColdStartFailed(BlocksError):
    """A request for an app with no replica: its start failed, or starts are backed off after failures: 503.

    Every request waiting for the start gets it at once (not at the end of
    ``cold_start_timeout``), and so does every new one while the backoff
    lasts; ``retry-after`` is when the next start may be tried.
    """

    status = 503
    error_reason = "cold_start_failed"

    def __init__(self, message: str, *, app: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.app = app
        self.retry_after = retry_after
        self.headers = _retry_after_headers(retry_after)


class SessionLost(BlocksError):
    """A session's replica is lost, or its worker no longer hosts the session: 410, or 503.

    Never a silent move to another replica (unless the app's sessions may
    move: ``on_replica_loss = "restart"``): the client starts a new session.
    ``reason`` goes on the wire in ``proxyblocks-session-ended``:

    - ``replica-gone`` (410, the proxy: the replica left the routes or is ``down``);
    - ``not-hosted`` (410, the worker: it ended the session (idle, terminated,
      its replica lost or drained), or it restarted);
    - ``drained`` (410, the worker: its replica was drained past the maximum drain time);
    - ``replica-unreachable`` (503, the worker: it could not reach the
      session's replica, which took the session's state with it; the worker
      ends every session it hosted there, so this answer comes once per session).
    """

    status = 410
    error_reason = "session_lost"

    def __init__(self, message: str, *, reason: str, status: int = 410) -> None:
        super().__init__(message, status=status, error_reason="session_lost")
        self.reason = reason
        self.headers = [(fields.ENDED_HEADER, reason.encode())]


# -- route sources ----------------------------------------------------------------------------


class SourceError(BlocksError):
    """Root of the route sources' errors. Never reaches a client: routing reads memory."""

    status = 503
    error_reason = "no_route"


class SourceUnavailable(SourceError):
    """The source cannot be reached, answered nonsense, or the watch broke (or went silent).

    The reconciler keeps serving the last good state and retries with backoff.
    """


class Compacted(SourceError):
    """The history a watch asked for is gone: the reconciler reloads a snapshot.

    ``compact_revision`` is the oldest revision the source still has history
    after (a watch from it or later would work), or 0 if unknown.
    """

    def __init__(self, message: str = "", *, compact_revision: int = 0) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


class RouteFileError(ValueError):
    """A route file that cannot be read or does not follow the format. Says where.

    Raised at startup or when a watched file changes, never on a request:
    a command line turns it into a one-line error and exit code 2; a
    running store keeps its last good routes.
    """


# -- tokens -------------------------------------------------------------------------------------


class TokenReason(enum.Enum):
    """Why a token was rejected, in the order the checks run (see :mod:`blocks.tokens`)."""

    TOO_LARGE = "too_large"
    MALFORMED = "malformed"
    UNKNOWN_KEY = "unknown_key"
    BAD_SIGNATURE = "bad_signature"
    WRONG_KIND = "wrong_kind"
    WRONG_APP = "wrong_app"
    EXPIRED = "expired"
    NOT_YET_VALID = "not_yet_valid"


class InvalidToken(Unauthorized):
    """A token failed a check: 401 with ``www-authenticate: Bearer`` if it escapes a handler.

    ``reason`` says which check (a :class:`TokenReason`). Like every
    :class:`~blocks.errors.BlocksError` message, this one goes to logs and
    statistics only, and it never contains the token.
    """

    def __init__(self, reason: TokenReason) -> None:
        super().__init__(f"token rejected: {reason.value}")
        self.reason = reason


__all__ = [
    "TokenReason",
    "NEXT_HOP_REASONS",
    "REASONS",
    "RETRYABLE_REASONS",
    "UPSTREAM_REASONS",
    "BlocksError",
    "BadRequest",
    "ColdStartFailed",
    "ColdStartFull",
    "ColdStartTimeout",
    "Compacted",
    "HopFailed",
    "InvalidToken",
    "NoRoute",
    "PayloadTooLarge",
    "QueueFull",
    "QueueTimeout",
    "RouteFileError",
    "SessionLost",
    "SourceError",
    "SourceUnavailable",
    "StreamReset",
    "Unauthorized",
    "UpstreamConnectError",
    "UpstreamProtocolError",
    "UpstreamTimeout",
    "error_field",
    "parse_error_field",
    "status_reason",
]
