"""The small vocabulary every layer shares, sans-IO modules included: no trio, no I/O.

``Headers`` and ``Address`` are exported publicly by :mod:`blocks.http` and
:mod:`blocks.transport`; :func:`finite` is the attrs validator of every
configuration's float seconds and ratios.
"""

from __future__ import annotations

import math

import attrs

Headers = list[tuple[bytes, bytes]]
"""Lowercase header names and their values, in wire order."""

Address = tuple[str, int]
"""A host and a port."""


def finite(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    """An attrs validator: ``value`` is a finite number (no NaN, no infinity)."""
    if not math.isfinite(value):
        raise ValueError(f"{attribute.name} must be finite, not {value!r}")
