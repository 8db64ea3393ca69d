"""Observability: the access log, request ids and ``traceparent``, logging setup.

(This file is the ACCESS-LOG branch's placeholder: the METRICS engineer owns
``blocks/observe/__init__.py``; on merge, keep his and add the block below.)
"""

# -- access log, request ids, logging (ACCESS-LOG engineer) -------------------------------------
from blocks.observe._accesslog import AccessLog, AccessLogStatistics, open_access_log
from blocks.observe._ids import RequestIds, new_request_id, new_traceparent, valid_request_id, valid_traceparent
from blocks.observe._logging import LEVELS, configure_logging

__all__ = [
    # -- access log, request ids, logging (ACCESS-LOG engineer) --
    "LEVELS",
    "AccessLog",
    "AccessLogStatistics",
    "RequestIds",
    "configure_logging",
    "new_request_id",
    "new_traceparent",
    "open_access_log",
    "valid_request_id",
    "valid_traceparent",
]
