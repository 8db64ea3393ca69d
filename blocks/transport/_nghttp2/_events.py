"""The nghttp2 codec's events: plain slotted objects with the attributes the contract names.

What each one carries is the contract's (:mod:`blocks.transport._codec`,
per :class:`~blocks.transport._codec.EventKind`); ``stream_ended`` is True
or None, as the drivers only ask whether it is None.
"""

from __future__ import annotations

from typing import Any


class RequestReceived:
    __slots__ = ("headers", "stream_ended", "stream_id")

    def __init__(self, stream_id: int, headers: list[Any], stream_ended: bool | None) -> None:
        self.stream_id = stream_id
        self.headers = headers
        self.stream_ended = stream_ended

    def __repr__(self) -> str:
        return f"<RequestReceived stream_id:{self.stream_id}, headers:{self.headers}>"


class ResponseReceived(RequestReceived):
    __slots__ = ()

    def __repr__(self) -> str:
        return f"<ResponseReceived stream_id:{self.stream_id}, headers:{self.headers}>"


class TrailersReceived(RequestReceived):
    __slots__ = ()

    def __repr__(self) -> str:
        return f"<TrailersReceived stream_id:{self.stream_id}, headers:{self.headers}>"


class DataReceived:
    __slots__ = ("data", "flow_controlled_length", "stream_ended", "stream_id")

    def __init__(self, stream_id: int, data: bytes, flow_controlled_length: int, stream_ended: bool | None) -> None:
        self.stream_id = stream_id
        self.data = data
        self.flow_controlled_length = flow_controlled_length
        self.stream_ended = stream_ended

    def __repr__(self) -> str:
        return f"<DataReceived stream_id:{self.stream_id}, flow_controlled_length:{self.flow_controlled_length}>"


class StreamEnded:
    __slots__ = ("stream_id",)

    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id

    def __repr__(self) -> str:
        return f"<StreamEnded stream_id:{self.stream_id}>"


class StreamReset:
    __slots__ = ("error_code", "remote_reset", "stream_id")

    def __init__(self, stream_id: int, error_code: int, remote_reset: bool = True) -> None:
        self.stream_id = stream_id
        self.error_code = error_code
        self.remote_reset = remote_reset

    def __repr__(self) -> str:
        return f"<StreamReset stream_id:{self.stream_id}, error_code:{self.error_code!r}>"


class WindowUpdated:
    __slots__ = ("delta", "stream_id")

    def __init__(self, stream_id: int, delta: int) -> None:
        self.stream_id = stream_id
        self.delta = delta

    def __repr__(self) -> str:
        return f"<WindowUpdated stream_id:{self.stream_id}, delta:{self.delta}>"


class RemoteSettingsChanged:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<RemoteSettingsChanged>"


class ConnectionTerminated:
    __slots__ = ("additional_data", "error_code", "last_stream_id")

    def __init__(self, error_code: int, last_stream_id: int, additional_data: bytes) -> None:
        self.error_code = error_code
        self.last_stream_id = last_stream_id
        self.additional_data = additional_data

    def __repr__(self) -> str:
        return f"<ConnectionTerminated error_code:{self.error_code!r}, last_stream_id:{self.last_stream_id}>"


class PingAckReceived:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<PingAckReceived>"
