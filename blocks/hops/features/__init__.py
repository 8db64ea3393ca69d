"""Hop features over one block each, a file per feature (``cold_start``: over the route cache).

Their public names are exported by :mod:`blocks.hops`.
"""

__all__: list[str] = []
