"""Every attribute a cgraw module reads from another cgraw module it imported exists there.

Much of cgraw runs only on a GPU (the replay path, the CUDA backend of the trees), so a renamed
module-level name that one of those paths still reads would pass the CPU tier and fail on the
device. This reads every module's source: for each ``import cgraw.x as y`` / ``from cgraw import
x`` binding a module, each ``y.name`` it loads must be an attribute of that module once imported
(modules import without torch or CuPy; their framework imports are lazy)."""

from __future__ import annotations

import ast
import importlib
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _module_aliases(tree) -> dict:
    """``{local name: module}`` of the cgraw modules a source file binds to a name."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "cgraw":
            for a in node.names:
                try:
                    out[a.asname or a.name] = importlib.import_module(f"{node.module}.{a.name}")
                except ImportError:
                    pass  # a name, not a module
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "cgraw" and a.asname:
                    out[a.asname] = importlib.import_module(a.name)
    return out


def _missing(source: str, label: str) -> list[str]:
    tree = ast.parse(source, filename=label)
    aliases = _module_aliases(tree)
    return [f"{label}:{node.lineno}: {node.value.id}.{node.attr}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
            and isinstance(node.value, ast.Name) and node.value.id in aliases
            and not hasattr(aliases[node.value.id], node.attr)]


def test_attributes_read_from_imported_cgraw_modules_exist():
    files = sorted((ROOT / "cgraw").rglob("*.py"))
    assert len(files) > 40
    missing = [m for f in files for m in _missing(f.read_text(), str(f.relative_to(ROOT)))]
    assert not missing, "reads of names the module does not have:\n" + "\n".join(missing)


def test_the_check_finds_a_missing_name():
    source = "from cgraw.runtime import stream as _streams\n\ndef f():\n    return _streams.no_such_name(0)\n"
    assert _missing(source, "probe.py") == ["probe.py:4: _streams.no_such_name"]


def _unresolved_imports(source: str, label: str) -> list[str]:
    """``import cgraw.x`` and ``from cgraw.x import y`` statements (anywhere, function bodies too)
    whose module does not exist or has no ``y``."""
    out = []
    for node in ast.walk(ast.parse(source, filename=label)):
        if isinstance(node, ast.Import):
            names = [(a.name, None) for a in node.names if a.name.split(".")[0] == "cgraw"]
        elif (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
              and node.module.split(".")[0] == "cgraw"):
            names = [(node.module, a.name) for a in node.names]
        else:
            continue
        for module, name in names:
            try:
                mod = importlib.import_module(module)
            except ImportError:
                out.append(f"{label}:{node.lineno}: no module {module}")
                continue
            if name is not None and name != "*" and not hasattr(mod, name):
                try:
                    importlib.import_module(f"{module}.{name}")
                except ImportError:
                    out.append(f"{label}:{node.lineno}: {module} has no {name}")
    return out


def test_every_cgraw_import_in_the_repository_resolves():
    """A module that moved or a name that was renamed fails here, whether it is imported at the
    top of a file or inside a function that only runs on a GPU."""
    files = [f for d in ("cgraw", "tests", "benchmarks", "tools") for f in sorted((ROOT / d).rglob("*.py"))]
    bad = [m for f in files for m in _unresolved_imports(f.read_text(), str(f.relative_to(ROOT)))]
    assert not bad, "\n".join(bad)


def test_the_import_check_finds_a_moved_module_and_a_missing_name():
    source = "def f():\n    from cgraw.no_such_module import x\n    from cgraw.runtime.stream import no_such_name\n"
    assert _unresolved_imports(source, "p.py") == ["p.py:2: no module cgraw.no_such_module",
                                                   "p.py:3: cgraw.runtime.stream has no no_such_name"]
