"""The retry budget: retries at most a share of requests over a sliding window, plus a floor. Sans-IO.

Theory of operation. Retries help when failures are rare and hurt when they
are not: a proxy that retries every failed request doubles the load on a
fleet that is already failing. So retries draw on a budget, the way Envoy's
``retry_budget`` and linkerd's ``retryBudget`` do: over the last ``window``
seconds, at most ``ratio`` of the requests counted, plus a floor of
``min_per_second`` retries per second so that a quiet service can still
retry its rare failure::

    allowed = ratio * requests_in_window + min_per_second * window

The hot path counts a request with one integer add (``budget.requests += 1``,
no allocation, no clock); the clock is read only when a retry is wanted.
The window slides in ``window / 10`` steps: a step's retries, and the count
of requests when it started, leave the window together once the step's end
is ``window`` old (so no retry leaves early: the budget looks back between
``window`` and ``1.1 * window``). Requests counted while no step was open
(before the first look, or after a window with no look) count in the next
step: at worst, after a quiet spell, a few requests older than the window.
"""

from __future__ import annotations

import collections

import attrs

from blocks._common import finite

_STEPS = 10


@attrs.frozen(kw_only=True)
class RetryBudgetConfig:
    """How many retries the budget allows. Durations in seconds.

    - ``ratio``: retries as a share of the requests counted over the window
      (0.2: one retry for every five requests);
    - ``window``: how far back the budget looks (10 s);
    - ``min_per_second``: a floor, so a quiet service can still retry (10).
    """

    ratio: float = attrs.field(default=0.2, validator=[attrs.validators.ge(0.0), finite])
    window: float = attrs.field(default=10.0, validator=[attrs.validators.gt(0.0), finite])
    min_per_second: float = attrs.field(default=10.0, validator=[attrs.validators.ge(0.0), finite])


@attrs.frozen
class RetryBudgetStatistics:
    """``requests``: counted since the budget was made; ``retries``: taken; ``refused``: retries
    the budget refused; ``available``: retries it would allow now (with ``now``, else at its last look)."""

    requests: int
    retries: int
    refused: int
    available: float


class RetryBudget:
    """Retries at most ``ratio`` of the requests over a sliding ``window``, plus ``min_per_second``. Sans-IO.

    Count every request with ``budget.requests += 1`` (or :meth:`request`),
    and ask :meth:`try_retry` before each retry: False when the budget is
    spent (then answer the original error). ``now`` is any monotonic clock
    in seconds, the same for every call. Standalone: a proxy and an edge
    each keep their own.
    """

    def __init__(self, config: RetryBudgetConfig | None = None) -> None:
        self.config = config or RetryBudgetConfig()
        self.requests = 0
        """Requests counted so far: the hot path adds 1 per request."""
        self.retries = 0
        self.refused = 0
        # Each step: [when it started, self.requests then, retries taken in it].
        self._steps: collections.deque[list[float]] = collections.deque()
        self._in_window = 0  # retries taken in the steps kept
        self._looked = 0  # self.requests at the last look
        self._available = self.config.min_per_second * self.config.window

    def __repr__(self) -> str:
        return f"<RetryBudget requests={self.requests} retries={self.retries} refused={self.refused}>"

    def request(self) -> None:
        """Count one request (the same as ``budget.requests += 1``)."""
        self.requests += 1

    def _slide(self, now: float) -> list[float]:
        config = self.config
        steps = self._steps
        width = config.window / _STEPS
        while steps and steps[0][0] + width <= now - config.window:  # (a step ends, at the latest, width on)
            self._in_window -= int(steps.popleft()[2])
        if not steps:
            steps.append([now, float(self._looked), 0.0])  # what came since the last look counts from here
        elif now >= steps[-1][0] + width:
            steps.append([now, float(self.requests), 0.0])
        self._looked = self.requests
        return steps[-1]

    def available(self, now: float) -> float:
        """How many retries the budget would allow at ``now``."""
        self._slide(now)
        config = self.config
        requests = self.requests - self._steps[0][1]
        self._available = config.ratio * requests + config.min_per_second * config.window - self._in_window
        return self._available

    def try_retry(self, now: float) -> bool:
        """Take one retry at ``now``: True if the budget allows it (it is counted), False if it is spent."""
        if self.available(now) < 1.0:
            self.refused += 1
            return False
        self._steps[-1][2] += 1
        self._in_window += 1
        self.retries += 1
        self._available -= 1
        return True

    def statistics(self, now: float | None = None) -> RetryBudgetStatistics:
        """A snapshot."""
        available = self.available(now) if now is not None else self._available
        return RetryBudgetStatistics(self.requests, self.retries, self.refused, max(available, 0.0))
