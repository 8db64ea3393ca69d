"""Sticky sessions: a signed session token names its replica; any proxy routes it with no lookup.

Stateful apps (a voice agent holding decoder state, a chat room, a game)
need every request and every reconnect of a session to reach the same
replica, while the proxies stay stateless and scale out. A session token
(:mod:`blocks.tokens`, kind ``session``) carries the app, the tenant, the
session id and the replica; a proxy verifies it locally in microseconds and
forwards the request to that replica's worker. No session table at the
proxy, no lookup, no network call on a session's request path.

The life of a session
---------------------

1. ``POST /.proxyblocks/sessions`` on a sessioned app's domain (with a
   proxy-auth token when the app requires one): the proxy's
   :class:`SessionBroker` reserves the replica with the most free session
   places (or waits in the app's bounded, fair queue: 429 when the queue is
   full, 503 at its deadline), asks that replica's worker to open the
   session, and answers ``201`` with ``{"session", "token", "replica",
   "expires_at"}`` (and the token in a cookie, for browsers and their
   WebSockets). Sharing the token lets several clients into one session.
2. Every request carrying the token (the ``proxyblocks-session`` header or
   cookie) goes to that replica, with the session id in
   ``x-proxyblocks-session`` for the app. If the replica left the routes or
   is ``down``: ``410``, never a silent move.
3. The worker (:class:`SessionTracker`) counts each session's requests in
   flight, ends it after ``idle_timeout`` without one, or on ``DELETE
   /.proxyblocks/sessions`` with its token, and reports its sessions per
   replica in its load answer: what the proxy's estimate and the autoscaler
   (sessions are a sessioned app's unit) read. A request of a session the
   worker no longer hosts gets a 410 too.

Module map: ``_core`` (sans-IO: :class:`SessionPlacer`, :class:`SessionTracker`,
configs), ``_broker`` (the proxy's trio side).
"""

from blocks.errors import SessionLost
from blocks.fields import ENDED_HEADER, SESSION_HEADER, SESSIONS_PATH
from blocks.sessions._broker import SessionBroker, open_sessions, session_control_response
from blocks.sessions._core import (
    AppSessions,
    ReplicaSessions,
    SessionConfig,
    SessionPlacer,
    SessionStatistics,
    SessionTicket,
)
from blocks.sessions._core_tracker import SessionTracker, TrackerStatistics, WorkerSessionConfig

__all__ = [
    "ENDED_HEADER",
    "SESSIONS_PATH",
    "SESSION_HEADER",
    "AppSessions",
    "ReplicaSessions",
    "SessionBroker",
    "SessionConfig",
    "SessionLost",
    "SessionPlacer",
    "SessionStatistics",
    "SessionTicket",
    "SessionTracker",
    "TrackerStatistics",
    "WorkerSessionConfig",
    "open_sessions",
    "session_control_response",
]

from blocks._meta import fixup_module_metadata  # (last: after every name is bound)

fixup_module_metadata(__name__, globals())
del fixup_module_metadata
