"""The documentation builds, stays in shape, and its CPU examples run (CPU tier).

- ``mkdocs build --strict`` of ``mkdocs.yml`` succeeds (skipped where mkdocs is not installed:
  ``pip install -e '.[docs]'``);
- README.md is at most 250 lines, and every page under docs/ is in the navigation;
- every ``cgraw.__all__`` name is on the API page and every ``cgraw.config`` field on the config page;
- the Python blocks of README.md and docs/ that need no GPU run here (the others: tests/gpu/test_readme.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys

import doc_blocks
import pytest

import cgraw

ROOT = doc_blocks.ROOT
README_MAX_LINES = 250


def _nav_pages() -> set[str]:
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with mkdocs: pip install -e '.[docs]'")

    class _Loader(yaml.SafeLoader):  # mkdocs.yml may carry !!python/name tags; the nav needs none
        pass

    _Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_Loader)
    pages: set[str] = set()

    def walk(item):
        if isinstance(item, str):
            pages.add(item)
        elif isinstance(item, dict):
            for value in item.values():
                walk(value)
        elif isinstance(item, list):
            for value in item:
                walk(value)

    walk(config["nav"])
    return pages


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs is not installed: pip install -e '.[docs]'")
def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed: pip install -e '.[docs]'")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_readme_is_short():
    lines = doc_blocks.README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the manual belongs in docs/"


def test_every_docs_page_is_in_the_nav():
    pages = {str(p.relative_to(doc_blocks.DOCS)) for p in doc_blocks.DOCS.rglob("*.md")}
    nav = _nav_pages()
    assert pages - nav == set(), "pages missing from mkdocs.yml's nav"
    assert nav - pages == set(), "nav entries without a page"


def test_api_page_lists_every_public_name():
    text = (doc_blocks.DOCS / "reference" / "api.md").read_text()
    missing = [n for n in cgraw.__all__
               if f"::: cgraw.{n}\n" not in text and f"::: cgraw.{n}.{n}\n" not in text and f"### {n}\n" not in text]
    assert missing == []


def test_config_page_lists_every_field():
    text = (doc_blocks.DOCS / "reference" / "config.md").read_text()
    missing = [f.name for f in dataclasses.fields(cgraw.config) if f"| `{f.name}` |" not in text]
    assert missing == []


CPU_BLOCKS = [(label, src) for label, src in doc_blocks.blocks() if not doc_blocks.needs_gpu(src)]


def test_docs_have_a_cpu_example():
    assert CPU_BLOCKS


@pytest.mark.parametrize("label, src", CPU_BLOCKS, ids=[label for label, _ in CPU_BLOCKS])
def test_cpu_example_runs(label, src):
    exec(compile(src, label, "exec"), {"__name__": "doc_example"})


def test_every_public_name_method_and_property_has_a_docstring():
    """The API reference is generated from docstrings: every public name, and every public method
    and property of a public class, says what it does."""
    import inspect

    missing = []
    for name in cgraw.__all__:
        obj = getattr(cgraw, name)
        if not inspect.getdoc(obj) and (inspect.isclass(obj) or callable(obj)):
            missing.append(name)
        if not inspect.isclass(obj):
            continue
        for attr, v in vars(obj).items():
            if attr.startswith("_"):
                continue
            f = v.fget if isinstance(v, property) else getattr(v, "__func__", v)
            if (isinstance(v, property) or callable(f)) and not getattr(f, "__doc__", None):
                missing.append(f"{name}.{attr}")
    assert not missing, f"no docstring: {missing}"
