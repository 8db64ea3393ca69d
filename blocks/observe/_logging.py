"""``--log-level``: one stdlib logging setup for every command, one line per record.

The blocks log through ``logging.getLogger("blocks.<block>")`` and never
configure logging themselves; a command (or your own program) calls
:func:`configure_logging` once. What the levels carry:

- ``error``: a bug caught at a boundary (a feature that raised, with its
  traceback), costing one request.
- ``warning``: a change of state an operator should hear about, logged once
  per change, never per request: a route file that fails to parse (and
  when it parses again), a route source lost and back, a replica
  unreachable or ejected and back in selection, a tenant the scheduler
  starts refusing (and when it is admitted again), the access log's writes
  failing and working again.
- ``info``: one line per listener as it opens, reloads.
- ``debug``: per-request detail (each error answer and why).
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

LEVELS = ("debug", "info", "warning", "error")
"""The names ``--log-level`` takes (any case)."""

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str = "info", *, stream: TextIO | None = None, prefix: str = "") -> None:
    """Send every record at ``level`` or above to ``stream`` (default: standard error), one line each.

    ``prefix`` starts each line (``"proxy a: "``: which of several processes sharing a stderr).

    ``level``: one of :data:`LEVELS`, any case; anything else raises
    ``ValueError`` naming the choices (a command turns it into one line).
    Calling it again replaces the handler it installed, so a reload may
    change the level.
    """
    name = level.strip().lower()
    if name not in LEVELS:
        raise ValueError(f"log level {level!r}: expected one of {', '.join(LEVELS)}")
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_proxyblocks", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter(prefix.replace("%", "%%") + FORMAT, datefmt="%Y-%m-%dT%H:%M:%S"))
    handler._proxyblocks = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(name.upper())


__all__ = [
    "LEVELS",
    "configure_logging",
]
