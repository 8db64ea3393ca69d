"""The settings table of the hyper-h2 codec: h2's, in less memory (:class:`CompactSettings`), and our
own settings as sent without the concurrent-stream limit h2 would enforce itself."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import h2.settings


class CompactSettings(h2.settings.Settings):
    """h2's settings, each value's history in a list where h2 keeps a ``deque`` (624 bytes each).

    A connection holds two of these (ours and the peer's), some ten values
    each: h2's deques cost about 10 KiB per connection, a quarter of an idle
    one's memory; lists of one value, about 1.5 KiB.
    """

    def __init__(self, client: bool = True, initial_values: Mapping[Any, int] | None = None) -> None:
        super().__init__(client, dict(initial_values) if initial_values is not None else None)
        self._settings = cast(Any, {key: list(values) for key, values in self._settings.items()})

    def __setitem__(self, key: Any, value: int) -> None:
        super().__setitem__(key, value)  # appends to our list, or starts a deque for a new key
        values: Any = self._settings[key]
        if type(values) is not list:
            self._settings[key] = cast(Any, list(values))

    def acknowledge(self) -> dict[Any, h2.settings.ChangedSetting]:
        changed = {}
        settings: dict[Any, list[int]] = cast(Any, self._settings)
        for key, values in settings.items():
            if len(values) > 1:
                old = values.pop(0)
                changed[key] = h2.settings.ChangedSetting(key, old, values[0])
        return changed


class _StreamsUncountedSettings(CompactSettings):
    """Our settings, as sent, except that h2 reads no concurrent-stream limit from them.

    h2 answers a HEADERS frame past our SETTINGS_MAX_CONCURRENT_STREAMS with
    a connection error (PROTOCOL_ERROR); RFC 9113 5.1.2 makes it an error of
    that stream alone. A server that counts its streams itself (the listener:
    RST_STREAM(REFUSED_STREAM), which the client may retry) takes these. The
    value still goes out in the SETTINGS frame, which h2 builds from the items.
    """

    @property
    def max_concurrent_streams(self) -> int:
        return 2**31 - 1

    @max_concurrent_streams.setter
    def max_concurrent_streams(self, value: int) -> None:
        self[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] = value
