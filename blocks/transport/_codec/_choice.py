"""Which codec a process's HTTP/2 connections use: :func:`use_codec`, :func:`codec_in_use`, and
:func:`make_h2`, which makes one of the codec in use for one side of one hop.

One codec per process, chosen before the first connection (by the command
line's ``--codec``, or by a proxy author's call): hyper-h2 (``h2``, the
default and the reference), libnghttp2 (``nghttp2``), or ``auto``, which
takes libnghttp2 where it can be loaded and hyper-h2 elsewhere. Both speak
the same :class:`~blocks.transport._codec.Codec` contract and pass the same
tests; what differs is speed and the few documented points of
:func:`blocks.transport._nghttp2.make_nghttp2`.
"""

from __future__ import annotations

from typing import Any

from blocks.transport._codec._contract import Codec
from blocks.transport._codec._h2codec import make_hyper_h2

CODECS = ("h2", "nghttp2", "auto")
"""The names :func:`use_codec` takes."""

_in_use = ["h2"]
_make: list[Any] = [make_hyper_h2]


class CodecUnavailable(RuntimeError):
    """``use_codec("nghttp2")`` where libnghttp2 cannot be loaded; the message says why in one line."""


def _nghttp2() -> Any:
    """``make_nghttp2``, or the one-line reason libnghttp2 cannot be used here."""
    try:
        from blocks.transport._nghttp2 import make_nghttp2
    except ImportError as exc:
        return str(exc)
    return make_nghttp2


def use_codec(name: str) -> str:
    """Make ``name`` (one of :data:`CODECS`) the codec of the connections made from now on; the name of
    the one in use. ``CodecUnavailable`` for ``nghttp2`` without libnghttp2, ``ValueError`` for another name.

    Connections already open keep theirs: choose at startup.
    """
    if name not in CODECS:
        raise ValueError(f"unknown HTTP/2 codec {name!r} (one of {', '.join(CODECS)})")
    if name == "h2":
        _in_use[0], _make[0] = "h2", make_hyper_h2
        return "h2"
    make = _nghttp2()
    if isinstance(make, str):
        if name == "nghttp2":
            raise CodecUnavailable(make)
        _in_use[0], _make[0] = "h2", make_hyper_h2
        return "h2"
    _in_use[0], _make[0] = "nghttp2", make
    return "nghttp2"


def codec_in_use() -> str:
    """``"h2"`` or ``"nghttp2"``: what :func:`make_h2` makes now."""
    return _in_use[0]


def make_h2(**kwargs: Any) -> Codec:
    """A codec of the one in use for one side of one hop; the arguments are :func:`make_hyper_h2`'s."""
    codec: Codec = _make[0](**kwargs)
    return codec
