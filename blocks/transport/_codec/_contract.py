"""The codec contract: what the h2 drivers call on a codec, and how they tell its events apart.

:class:`Codec` lists every member the driver side uses, :class:`EventKind`
what an event is, :data:`ProtocolError` and :data:`ErrorCodes` what every
codec raises and reports. What each one must mean is the package docstring's
(:mod:`blocks.transport._codec`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

import h2.errors
import h2.exceptions

from blocks.http import Headers

ProtocolError = h2.exceptions.ProtocolError
"""What every codec raises for a protocol error (a second codec raises a subclass)."""

ErrorCodes = h2.errors.ErrorCodes
"""The RFC 9113 (7) error codes, an ``IntEnum``: a codec takes and reports these values."""


class EventKind(enum.Enum):
    """What a codec's event is, for the driver to pick its handler (see the package docstring)."""

    REQUEST = "request"
    RESPONSE = "response"
    DATA = "data"
    TRAILERS = "trailers"
    STREAM_ENDED = "stream_ended"
    RESET = "reset"
    WINDOW_UPDATED = "window_updated"
    SETTINGS_CHANGED = "settings_changed"
    TERMINATED = "terminated"
    PING_ACK = "ping_ack"


class CodecSettings(Protocol):
    """The peer's settings, as far as the drivers read them."""

    @property
    def max_concurrent_streams(self) -> int: ...

    @property
    def enable_connect_protocol(self) -> int: ...


class Codec(Protocol):
    """One HTTP/2 connection's state machine: everything the drivers call (see the package docstring)."""

    event_kinds: ClassVar[Mapping[type, EventKind]]

    @property
    def max_outbound_frame_size(self) -> int:
        """The largest DATA payload one ``send_data`` may take."""

    @property
    def highest_inbound_stream_id(self) -> int: ...

    @property
    def remote_settings(self) -> CodecSettings: ...

    def initiate_connection(self) -> None:
        """Queue the preface (a client's) and our SETTINGS."""

    def receive_data(self, data: bytes | bytearray) -> list[Any]:
        """Feed received bytes; the events they make, in order."""

    def data_to_send(self) -> bytes:
        """Take every byte queued so far."""

    def send_headers(self, stream_id: int, headers: Headers, end_stream: bool = False) -> None:
        """A head (opening the stream if new) or, on a stream with a head, trailers."""

    def send_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        """One DATA frame: ``data`` fits the stream's and the connection's send windows and the frame size."""

    def end_stream(self, stream_id: int) -> None: ...

    def reset_stream(self, stream_id: int, error_code: int = 0) -> None: ...

    def acknowledge_received_data(self, acknowledged_size: int, stream_id: int) -> None:
        """Give received DATA bytes back (the connection's window, and the stream's while it is open)."""

    def local_flow_control_window(self, stream_id: int) -> int:
        """What may be sent on ``stream_id`` now (the smaller of its window and the connection's)."""

    def increment_flow_control_window(self, increment: int) -> None:
        """Open the connection's inbound window by ``increment``."""

    def close_connection(self, error_code: int = 0, *, last_stream_id: int | None = None) -> None:
        """Queue the final GOAWAY; the codec takes no frame after it."""

    def get_next_available_stream_id(self) -> int: ...

    def stream_is_open(self, stream_id: int) -> bool:
        """Whether the codec knows ``stream_id`` and has not closed it."""

    def inbound_books(self) -> tuple[int, int]:
        """``(window, unacknowledged)``: what the peer may still send; what was received and not given back."""

    def goaway_frame(self, last_stream_id: int) -> bytes:
        """A graceful GOAWAY(NO_ERROR) to write beside the state machine, which stays open."""

    def reopen_after_goaway(self) -> None:
        """After a received graceful GOAWAY: let the streams in flight finish."""

    def control_frame(self) -> None:
        """Count a control frame the driver saw (a window update that serves no stream); ProtocolError on a flood."""
