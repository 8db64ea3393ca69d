"""The mirror tee: a sampled share of requests copied to a shadow, never holding the primary up.

Sampling, the bounded body buffer and the comparison of answers are sans-IO
in ``_core.py``; the trio driver (:class:`Mirror`, :func:`open_mirror`, the
shadow exchanges and body-less sinks) is ``_driver.py``. See docs/mirror.md.
"""

from blocks.fields import MIRROR_HEADER
from blocks.mirror._core import MirrorPair, Observation, RouteComparison, Sampler
from blocks.mirror._driver import OUTCOMES, Mirror, MirrorConfig, MirrorStatistics, open_mirror

__all__ = [
    "MIRROR_HEADER",
    "OUTCOMES",
    "Mirror",
    "MirrorConfig",
    "MirrorPair",
    "MirrorStatistics",
    "Observation",
    "RouteComparison",
    "Sampler",
    "open_mirror",
]

from blocks._meta import fixup_module_metadata  # (last: after every name is bound)

fixup_module_metadata(__name__, globals())
del fixup_module_metadata
