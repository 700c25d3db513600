"""CPU tier: no module reads another module's private names (beside the layer test).

The rule, for every module of ``cgraw/`` and ``allocator/``: a name with one leading underscore
(``_lock``, not ``__name__``) is private to its module. Another module may not read it, by
``from cgraw.x import _name``, by ``x._name`` or ``getattr(x, "_name")`` on an imported module (also
through an alias such as ``y = x``, or a dotted ``cgraw.x._name``), and may not import a module
whose own name is private (``from cgraw import _defer``). What modules share gets a public name
where it is defined. Two exceptions:

- the modules of ``cgraw._cuda`` and of ``allocator`` may share that package's private names
  among themselves (``cgraw._cuda.graphs`` reads ``cgraw._cuda._R``); the modules of every other
  package (``cgraw.trees``, ``cgraw.interop.torch``, ...) share what they share under public names;
- ``cgraw._cuda``, the CUDA call layer, is private-named on purpose and every layer imports it
  (its private names stay private: ``_cuda._rt`` outside the package is a violation).

Tests may use private names; the rule is for the library.
"""

from __future__ import annotations

import ast
import pathlib
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
GATEWAY = "cgraw._cuda"  # a private-named package any module may import
TOP_LEVEL = ("cgraw", "allocator")
# the packages whose modules share private names: the CUDA call layer and the allocator; every other
# subpackage's modules share what they share under public names
SHARING = ("cgraw._cuda", "allocator")


def _module_files():
    for path in sorted((ROOT / "cgraw").rglob("*.py")) + sorted((ROOT / "allocator").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts)
        is_package = name.endswith(".__init__")
        if is_package:
            name = name[: -len(".__init__")]
        yield name, path, is_package


MODULES = {name: path for name, path, _ in _module_files()}
PACKAGES = {name for name, _, is_package in _module_files() if is_package}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _package_of(module: str, packages) -> str:
    return module if module in packages else module.rpartition(".")[0]


def violations(name: str, source: str, modules=None, packages=None) -> list[str]:
    """The private names of other modules that module ``name`` (whose text is ``source``) reads."""
    modules = MODULES if modules is None else modules
    packages = PACKAGES if packages is None else packages
    mine = _package_of(name, packages)

    def shares(owner: str) -> bool:
        """Whether ``name`` may read ``owner``'s private names: itself, or a module of its package."""
        if owner == name:
            return True
        theirs = _package_of(owner, packages)
        return theirs == mine and mine in SHARING

    def may_import_module(module: str) -> bool:
        last = module.rpartition(".")[2]
        return not _private(last) or module == GATEWAY or shares(module.rpartition(".")[0]) or shares(module)

    tree = ast.parse(source)
    found: list[str] = []
    aliases: dict[str, str] = {}  # local name -> the cgraw/allocator module it stands for

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] not in TOP_LEVEL:
                    continue
                if a.name in modules and not may_import_module(a.name):
                    found.append(f"{node.lineno}: imports the private module {a.name}")
                if a.asname:
                    aliases[a.asname] = a.name
                else:  # ``import cgraw.x`` binds ``cgraw``
                    aliases[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = mine.split(".")
                base = parts[: len(parts) - (node.level - 1)]
                source_mod = ".".join(base + ([node.module] if node.module else []))
            else:
                source_mod = node.module or ""
            if source_mod.split(".")[0] not in TOP_LEVEL:
                continue
            for a in node.names:
                full = f"{source_mod}.{a.name}"
                if full in modules:
                    aliases[a.asname or a.name] = full
                    if not may_import_module(full):
                        found.append(f"{node.lineno}: imports the private module {full}")
                elif _private(a.name) and not shares(source_mod):
                    found.append(f"{node.lineno}: from {source_mod} import {a.name}")

    changed = True  # ``y = x`` where ``x`` stands for a module: ``y`` does too (any scope)
    while changed:
        changed = False
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                for t in node.targets:
                    if isinstance(t, ast.Name) and aliases.get(t.id) != aliases[node.value.id]:
                        aliases[t.id] = aliases[node.value.id]
                        changed = True

    def module_of(expr) -> str | None:
        """The module an expression (``x``, ``cgraw.x``, ``pkg.x``) stands for, if any."""
        if isinstance(expr, ast.Name):
            return aliases.get(expr.id)
        if isinstance(expr, ast.Attribute):
            outer = module_of(expr.value)
            if outer is not None and f"{outer}.{expr.attr}" in modules:
                return f"{outer}.{expr.attr}"
        return None

    def check(owner: str, attr: str, lineno: int, how: str) -> None:
        if not _private(attr):
            return
        if f"{owner}.{attr}" in modules:
            if not may_import_module(f"{owner}.{attr}"):
                found.append(f"{lineno}: {how} (the private module {owner}.{attr})")
        elif not shares(owner):
            found.append(f"{lineno}: {how} ({owner}.{attr})")

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = module_of(node.value)
            if owner is not None:
                check(owner, node.attr, node.lineno, ast.unparse(node))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            owner = module_of(node.args[0])
            if owner is not None:
                check(owner, node.args[1].value, node.lineno, ast.unparse(node))
    return found


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_reads_another_modules_private_names(name):
    bad = violations(name, MODULES[name].read_text())
    assert not bad, f"{name} reads private names of other modules (give them a public name):\n" + "\n".join(bad)


# The check itself: each way of reading another module's private name is seen, and the allowed
# ones are not. A fake tree: cgraw/{a,b}.py, cgraw/_priv.py, cgraw/_cuda/{__init__,graphs}.py,
# cgraw/interop/{__init__,x,y}.py.
FAKE = {m: None for m in ("cgraw", "cgraw.a", "cgraw.b", "cgraw._priv", "cgraw._cuda", "cgraw._cuda.graphs",
                          "cgraw.interop", "cgraw.interop.x", "cgraw.interop.y", "allocator", "allocator.pool")}
FAKE_PACKAGES = {"cgraw", "cgraw._cuda", "cgraw.interop", "allocator"}


@pytest.mark.parametrize("name, source", [
    ("cgraw.a", "from cgraw.b import _x"),
    ("cgraw.a", "from cgraw import b\nb._x"),
    ("cgraw.a", "from cgraw import b as _b\nprint(_b._x)"),
    ("cgraw.a", "import cgraw.b as bb\nbb._x()"),
    ("cgraw.a", "import cgraw.b\ncgraw.b._x"),
    ("cgraw.a", "from cgraw import b\ndef f():\n    mod = b\n    return mod._x"),
    ("cgraw.a", "from cgraw import b\ngetattr(b, '_x')"),
    ("cgraw.a", "from cgraw import interop\ninterop.x._y"),
    ("cgraw.a", "from cgraw import _priv"),
    ("cgraw.a", "import cgraw._priv"),
    ("cgraw.a", "from cgraw import _cuda\n_cuda._rt"),
    ("cgraw.a", "from cgraw._cuda import _R"),
    ("cgraw.a", "def f():\n    from cgraw.interop.x import _helper\n    return _helper"),
    ("cgraw.interop.x", "from cgraw import b\nb._y"),
    ("allocator.pool", "import cgraw.b as b\nb._x"),
    ("cgraw.interop.x", "from cgraw.interop import y\ny._shared"),
    ("cgraw.interop.x", "from . import y\ny._shared"),
])
def test_the_check_sees_a_private_read(name, source):
    assert violations(name, textwrap.dedent(source), FAKE, FAKE_PACKAGES), source


@pytest.mark.parametrize("name, source", [
    ("cgraw.a", "from cgraw import b\nb.x, b.__name__, b.__doc__"),
    ("cgraw.a", "from cgraw import _cuda\n_cuda.check"),
    ("cgraw.a", "from cgraw._cuda import graphs\ngraphs.launch"),
    ("cgraw.a", "_x = 1\n_x"),
    ("cgraw.a", "import os\nos._exit"),
    ("cgraw._cuda.graphs", "from cgraw._cuda import _R, _compat"),
    ("cgraw._cuda", "from cgraw._cuda import graphs\ngraphs._launch"),
])
def test_the_check_allows(name, source):
    assert violations(name, textwrap.dedent(source), FAKE, FAKE_PACKAGES) == []
