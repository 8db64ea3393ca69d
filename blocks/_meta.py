"""Public names print public: what a public namespace exports is shown at its public path.

trio's ``fixup_module_metadata``: a class or function defined in a private
module (``blocks.routing._table``) and exported by a public one
(``blocks.routing``) gets the public module as its ``__module__``, and so do
a class's methods and nested classes, so reprs, tracebacks and ``help()``
name ``blocks.routing.RouteTable``, the path a user imports. Each public
namespace calls it last, on its own ``__all__``; an object already at a
public path (re-exported from another public namespace) is left as it is.
"""

from __future__ import annotations

from collections.abc import Mapping


def _private(module: str) -> bool:
    return any(part.startswith("_") for part in module.split("."))


def fixup_module_metadata(module_name: str, namespace: Mapping[str, object]) -> None:
    """Give every object of ``namespace["__all__"]`` defined in a private module of this project
    ``module_name`` as its ``__module__`` (and its class attributes likewise)."""
    seen: set[int] = set()

    def fix(obj: object) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        module = getattr(obj, "__module__", None)
        if not isinstance(module, str) or not module.startswith("blocks.") or not _private(module):
            return
        try:
            obj.__module__ = module_name
        except (AttributeError, TypeError):  # (a read-only one: a builtin's, a NamedTuple's field)
            return
        if isinstance(obj, type):
            for value in vars(obj).values():
                if isinstance(value, (type, staticmethod, classmethod, property)):
                    value = getattr(value, "__func__", None) or getattr(value, "fget", None) or value
                if getattr(value, "__module__", None) == module:
                    fix(value)

    names = namespace.get("__all__", ())
    assert isinstance(names, (list, tuple))
    for name in names:
        fix(namespace[name])
