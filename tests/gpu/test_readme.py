"""The README's Python examples run as written (GPU tier)."""

from __future__ import annotations

import pathlib
import re

import pytest

pytestmark = pytest.mark.gpu

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_example_runs(i):
    pytest.importorskip("torch")
    pytest.importorskip("cupy")
    import cgraw

    try:
        exec(compile(BLOCKS[i], f"README.md[python block {i}]", "exec"), {"__name__": f"readme_{i}"})
    finally:
        cgraw.mark_step_begin()
        cgraw.reset()
