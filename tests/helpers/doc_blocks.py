"""The Python code blocks of README.md and docs/**/*.md, for the tests that run them.

A block is a fence opened by exactly ```` ```python ```` and closed by ```` ``` ````; other fences
(```` ```bash ````, a bare ```` ``` ````) are not run. A block that mentions neither torch, CuPy nor
cgraw needs no GPU and runs in the CPU tier (``tests/unit/test_docs.py``); the others run in the
GPU tier (``tests/gpu/test_readme.py``).
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
FENCE = re.compile(r"```python\n(.*?)```", flags=re.S)
_GPU_WORDS = re.compile(r"\b(torch|cupy|cgraw)\b")


def pages() -> list[pathlib.Path]:
    """README.md, then every Markdown page under docs/, in a stable order."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def blocks() -> list[tuple[str, str]]:
    """``(label, source)`` of every Python block, the label naming the page and the block's index."""
    out = []
    for page in pages():
        for i, src in enumerate(FENCE.findall(page.read_text())):
            out.append((f"{page.relative_to(ROOT)}[python block {i}]", src))
    return out


def needs_gpu(src: str) -> bool:
    return bool(_GPU_WORDS.search(src))
