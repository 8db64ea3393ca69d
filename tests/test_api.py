"""The public namespace, and the sans-IO rule for decision logic."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import blocks
import blocks.testing

BLOCKS = Path(blocks.__file__).resolve().parent
WHOLE = ["routing", "tokens"]
"""Blocks that are sans-IO as a whole (they have no trio driver)."""
SANS_IO = [*WHOLE, *sorted(".".join(p.relative_to(BLOCKS).with_suffix("").parts) for p in BLOCKS.rglob("_core*.py"))]
"""Sans-IO modules: those blocks, and every block's ``_core.py`` and ``_core_*.py`` (a core split
in parts, found by name), whose trio driver sits beside them."""


def _sans_io_modules() -> list[tuple[str, Path]]:
    """``(dotted name under blocks, file)`` for every module of every sans-IO block."""
    found = []
    for block in SANS_IO:
        package = BLOCKS / block
        if package.is_dir():
            for path in sorted(package.glob("*.py")):
                name = block if path.stem == "__init__" else f"{block}.{path.stem}"
                found.append((name, path))
        else:
            found.append((block, BLOCKS.joinpath(*block.split(".")).with_suffix(".py")))
    return found


def _driver_packages(module: str) -> list[str]:
    """The packages whose ``__init__`` may load trio: those above ``module`` that are not sans-IO as a
    whole, and every package with a core (a core may use another block's core, never its driver)."""
    parts = module.split(".")[:-1]
    above = [".".join(parts[: i + 1]) for i in range(len(parts)) if ".".join(parts[: i + 1]) not in SANS_IO]
    cores = [name.rpartition(".")[0] for name in SANS_IO if name.rpartition(".")[2].startswith("_core")]
    return sorted(set(above) | set(cores))


def test_the_sans_io_list_names_real_modules() -> None:
    names = [name for name, path in _sans_io_modules() if path.exists()]
    expected = {
        "autoscaler._core",
        "routing",
        "routing._cache",
        "routing._policies",
        "routing._rendezvous",
        "scheduler._core",
        "scheduler._core_config",
        "mirror._core",
        "prober._core",
        "prober._core_signal",
        "tokens",
        "sessions._core",
        "sessions._core_tracker",
    }
    assert expected <= set(names)
    assert len(names) == len(_sans_io_modules())


NAMESPACES = [
    importlib.import_module(name)
    for name in (
        "blocks",
        "blocks.autoscaler",
        "blocks.command",
        "blocks.errors",
        "blocks.fields",
        "blocks.hops",
        "blocks.http",
        "blocks.mirror",
        "blocks.observe",
        "blocks.prober",
        "blocks.routing",
        "blocks.scheduler",
        "blocks.sessions",
        "blocks.simulate",
        "blocks.singleflight",
        "blocks.sources",
        "blocks.store",
        "blocks.testing",
        "blocks.timing",
        "blocks.tokens",
        "blocks.topology",
        "blocks.transport",
        "blocks.transport.listener",
        "blocks.transport.multiplexer",
        "blocks.transport.streams",
        "blocks.transport.tls",
        "blocks.websocket",
    )
]
"""The public namespaces: what a proxy author types (``blocks``), each block's whole API, the store's
vocabulary (``blocks.store``), and the demo apps and test helpers (``blocks.testing``)."""

EXPORTED = {name for namespace in NAMESPACES for name in namespace.__all__}
MAX_ROOT_NAMES = 90


def test_the_root_namespace_is_what_a_proxy_author_types() -> None:
    """About 80 names; the store's codecs and the test helpers live in their own namespaces."""
    assert len(blocks.__all__) <= MAX_ROOT_NAMES, len(blocks.__all__)
    assert not set(blocks.__all__) & set(importlib.import_module("blocks.store").__all__)


def test_every_public_module_is_a_listed_namespace() -> None:
    """Each block's package, each top-level module and each public transport module has ``__all__`` and is listed."""
    listed = {namespace.__name__ for namespace in NAMESPACES}
    public = set()
    for path in BLOCKS.rglob("*.py"):
        parts = path.relative_to(BLOCKS).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(part.startswith("_") for part in parts) or (len(parts) > 1 and parts[0] != "transport"):
            continue  # private, or a module inside a block's package (its package is the namespace)
        public.add(".".join(("blocks", *parts)))
    public -= {"blocks.routectl"}  # a command, not a namespace
    assert public <= listed, sorted(public - listed)


@pytest.mark.parametrize("namespace", NAMESPACES, ids=lambda m: m.__name__)
def test_every_exported_name_exists(namespace: types.ModuleType) -> None:
    missing = [name for name in namespace.__all__ if not hasattr(namespace, name)]
    assert missing == []
    assert len(set(namespace.__all__)) == len(namespace.__all__), "a name is exported twice"


@pytest.mark.parametrize("namespace", NAMESPACES, ids=lambda m: m.__name__)
def test_nothing_private_is_exported(namespace: types.ModuleType) -> None:
    assert [name for name in namespace.__all__ if name.startswith("_")] == []


def _defined_in(namespace: types.ModuleType, value: object) -> bool:
    """Whether ``value`` belongs to ``namespace``: defined there (or, for a package, in its modules); every constant."""
    module = getattr(value, "__module__", None)
    if module is None or module == namespace.__name__:
        return True
    return hasattr(namespace, "__path__") and module.startswith(namespace.__name__ + ".")


@pytest.mark.parametrize("namespace", NAMESPACES, ids=lambda m: m.__name__)
def test_the_package_defines_nothing_public_beyond_all(namespace: types.ModuleType) -> None:
    public = {
        name
        for name, value in vars(namespace).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and name not in ("annotations", "TYPE_CHECKING")
        and _defined_in(namespace, value)
    }
    assert public <= set(namespace.__all__), sorted(public - set(namespace.__all__))


def test_the_demo_and_test_helpers_are_not_in_the_root_namespace() -> None:
    assert not set(blocks.testing.__all__) & set(blocks.__all__)


def _imported_modules(path: Path) -> set[str]:
    """Every module an ``import`` statement in ``path`` names, wherever it sits."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.add(node.module)
    return names


def test_sans_io_modules_do_not_import_trio() -> None:
    for module, path in _sans_io_modules():
        imported = _imported_modules(path)
        assert not {name for name in imported if name == "trio" or name.startswith("trio.")}, module


# Loads ``blocks.<module>`` without running the package's ``__init__`` (which
# imports every block, trio ones included), nor that of a subpackage that holds
# a trio driver beside its sans-IO module (the names after the module), so that
# only what the module itself pulls in, directly or through other blocks, ends
# up in sys.modules.
_PROBE = """
import os, sys, types
for name in ["", *sys.argv[3:]]:
    package = types.ModuleType("blocks" + (name and "." + name))
    package.__path__ = [os.path.join(sys.argv[1], *name.split(".")) if name else sys.argv[1]]
    sys.modules[package.__name__] = package
__import__("blocks." + sys.argv[2])
print(" ".join(sorted(name for name in sys.modules if name.split(".")[0] in ("trio", "blocks"))))
"""


def test_sans_io_modules_load_without_trio() -> None:
    for module, _ in _sans_io_modules():
        result = subprocess.run(
            [sys.executable, "-c", _PROBE, str(BLOCKS), module, *_driver_packages(module)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        loaded = result.stdout.split()
        assert f"blocks.{module}" in loaded
        through = [name for name in loaded if name.startswith("blocks.")]
        assert "trio" not in loaded, f"importing blocks.{module} loads trio, through {through}"


TRANSPORT_MAY_IMPORT = (
    "blocks.transport",
    "blocks.http",
    "blocks.errors",
    "blocks.fields",
    "blocks.timing",
    "blocks._sync",
    "blocks._common",
    "blocks._meta",
)
"""The transport layer stands under every block: it imports itself and the shared vocabulary only."""


def test_the_transport_layer_imports_no_block() -> None:
    for path in sorted((BLOCKS / "transport").rglob("*.py")):
        found = {name for name in _imported_modules(path) if name == "blocks" or name.startswith("blocks.")}
        stray = {name for name in found if not name.startswith(TRANSPORT_MAY_IMPORT)}
        assert not stray, f"{path.relative_to(BLOCKS)} imports {sorted(stray)}"


def _named_types(annotation: object) -> set[str]:
    """The capitalised names in an annotation (hints are strings: ``from __future__ import annotations``)."""
    return set(re.findall(r"\b([A-Z][A-Za-z0-9_]*)\b", str(annotation)))


@pytest.mark.parametrize("namespace", NAMESPACES, ids=lambda m: m.__name__)
def test_every_type_a_public_signature_names_is_exported(namespace: types.ModuleType) -> None:
    """What a public function or method takes or returns, a user can import from a public namespace."""
    exported = EXPORTED
    ours = {
        name
        for module_name, module in list(sys.modules.items())
        if module_name == "blocks" or module_name.startswith("blocks.")
        for name, value in vars(module).items()
        if isinstance(value, type) and getattr(value, "__module__", "").startswith("blocks")
    }
    missing: dict[str, list[str]] = {}
    for name in namespace.__all__:
        value = getattr(namespace, name)
        members = [(name, value)] if not isinstance(value, type) else []
        if isinstance(value, type):
            for attr, member in vars(value).items():
                if attr.startswith("_") and attr != "__init__":
                    continue
                member = member.fget if isinstance(member, property) else member
                if callable(member):
                    members.append((f"{name}.{attr}", member))
        for label, function in members:
            for annotation in getattr(function, "__annotations__", {}).values():
                for named in _named_types(annotation) & ours - exported:
                    missing.setdefault(named, []).append(label)
    assert missing == {}, missing


def _package_of(path: Path) -> str:
    """The package a module of ``blocks`` belongs to: ``blocks.hops`` for hops/proxy.py, ``blocks`` for http.py."""
    parts = path.relative_to(BLOCKS.parent).with_suffix("").parts
    return ".".join(parts[:-1])


def _private_imports(path: Path) -> list[str]:
    """What ``path`` imports that is private to another package: a ``_module`` or a ``_name`` outside its own.

    One exception: a sans-IO core may import another block's core (``blocks.prober._core_signal`` from
    ``blocks/autoscaler/_core.py``), since the block's public package would load its trio driver.
    """
    package = _package_of(path)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom) or node.module is None or not node.module.startswith("blocks"):
            continue
        if path.stem.startswith("_core") and node.module.rpartition(".")[2].startswith("_core"):
            continue
        module = node.module.split(".")
        for i, part in enumerate(module):
            if part.startswith("_"):
                owner = ".".join(module[:i])  # the package whose private module it is
                if package != owner and not package.startswith(owner + "."):
                    found.append(node.module)
                break
        else:
            owner = node.module
            if package != owner and not package.startswith(owner + "."):
                found += [f"{node.module}.{alias.name}" for alias in node.names if alias.name.startswith("_")]
    return found


def test_no_module_imports_a_private_name_of_another_package() -> None:
    roots = [BLOCKS, BLOCKS.parent / "recipes"]
    stray = {
        str(path.relative_to(BLOCKS.parent)): found
        for root in roots
        for path in sorted(root.rglob("*.py"))
        if (found := _private_imports(path))
    }
    assert not stray, stray


# -- recipes: short, and built from public imports ----------------------------------------------------

RECIPES = sorted(p for p in (BLOCKS.parent / "recipes").glob("*.py") if p.name != "__init__.py")
MAX_RECIPE_LINES = 120


def test_the_recipes_are_found() -> None:
    assert {"chain", "chat", "fleet", "noisy_neighbour", "shadow"} <= {p.stem for p in RECIPES}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_a_recipe_is_under_120_lines_without_its_docstring(path: Path) -> None:
    tree = ast.parse(path.read_text(), str(path))
    docstring = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) else None
    assert docstring is not None and isinstance(ast.get_docstring(tree), str), f"{path.name} has no docstring"
    assert docstring.end_lineno is not None
    lines = len(path.read_text().splitlines()) - (docstring.end_lineno - docstring.lineno + 1)
    assert lines < MAX_RECIPE_LINES, f"{path.name}: {lines} lines without its docstring (STYLE.md: under 120)"


def _third_party_or_stdlib(module: str) -> bool:
    top = module.split(".")[0]
    return top not in ("blocks", "recipes", "tests", "bench", "support", "_harness")


PUBLIC = {namespace.__name__ for namespace in NAMESPACES}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_a_recipe_imports_only_public_names(path: Path) -> None:
    """Public namespaces of ``blocks`` (no private module or name), the standard library and third parties."""
    stray = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not (alias.name in PUBLIC or _third_party_or_stdlib(alias.name)):
                    stray.append(alias.name)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level or not (module in PUBLIC or _third_party_or_stdlib(module)):
                stray.append(f"from {'.' * node.level}{module}")
            stray += [f"{module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert stray == [], f"{path.name} imports {stray}"


@pytest.mark.parametrize("namespace", NAMESPACES, ids=lambda m: m.__name__)
def test_public_names_print_their_public_path(namespace: types.ModuleType) -> None:
    """What a public namespace exports names no private module in its repr, traceback or ``help()``
    (``blocks._meta.fixup_module_metadata``, trio's), nor do its classes' methods."""
    private = {}
    for name in namespace.__all__:
        value = getattr(namespace, name)
        objects = [value]
        if isinstance(value, type):
            objects += [v for v in vars(value).values() if callable(v) and hasattr(v, "__module__")]
        for obj in objects:
            module = getattr(obj, "__module__", None)
            if isinstance(module, str) and module.startswith("blocks") and "._" in module:
                private[f"{name}.{getattr(obj, '__name__', '')}"] = module
    assert private == {}


_PRIVATE_REFERENCE = re.compile(r"`~?(blocks(?:\.\w+)*\._\w+[\w.]*)`")


@pytest.mark.parametrize("namespace", NAMESPACES, ids=lambda m: m.__name__)
def test_public_docstrings_name_no_private_module(namespace: types.ModuleType) -> None:
    """A public namespace's docstring, and those of what it exports (methods included), point a
    reader to public paths only: a cross-reference to ``blocks.x._y`` is one they cannot import."""
    found: dict[str, list[str]] = {}
    documented: list[tuple[str, object]] = [(namespace.__name__, namespace)]
    for name in namespace.__all__:
        value = getattr(namespace, name)
        documented.append((name, value))
        if isinstance(value, type):
            documented += [(f"{name}.{attr}", v) for attr, v in vars(value).items() if callable(v)]
    for name, obj in documented:
        refs = _PRIVATE_REFERENCE.findall(getattr(obj, "__doc__", None) or "")
        if refs and isinstance(obj, (type, types.FunctionType, types.ModuleType)):
            found[name] = refs
    assert found == {}


def test_every_public_module_says_what_it_exports() -> None:
    """Every module a user may import (no ``_`` in its path) has ``__all__``."""
    missing = [
        str(path.relative_to(BLOCKS))
        for path in sorted(BLOCKS.rglob("*.py"))
        if not any(part.startswith("_") and part != "__init__.py" for part in path.relative_to(BLOCKS).parts)
        and not re.search(r"^__all__\b", path.read_text(), re.MULTILINE)
    ]
    assert missing == []


VOCABULARY = ("blocks.errors", "blocks.fields", "blocks.timing", "blocks._common")
"""The words every layer shares. ``blocks.http`` joins them once ``Request.exchange`` is gone (issue 33)."""


def test_the_vocabulary_imports_nothing_above_it() -> None:
    """``errors``, ``fields`` and ``timing`` import only each other and ``_common``, ``TYPE_CHECKING``
    imports included: no block, no hop."""
    for module in VOCABULARY:
        path = BLOCKS / (module.removeprefix("blocks.").replace(".", "/") + ".py")
        named = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module == "blocks":
                named.update(f"blocks.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module is not None:
                named.add(node.module)
            elif isinstance(node, ast.Import):
                named.update(alias.name for alias in node.names)
        above = {name for name in named if name.startswith("blocks") and name not in VOCABULARY}
        assert not above, f"{module} imports {sorted(above)}"
