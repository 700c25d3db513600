"""The Python examples of README.md and docs/ run as written (GPU tier).

Blocks are found by ``tests/helpers/doc_blocks.py``; those that need no GPU run in the CPU tier
(``tests/unit/test_docs.py``) instead.
"""

from __future__ import annotations

import doc_blocks
import pytest

pytestmark = pytest.mark.gpu

BLOCKS = [(label, src) for label, src in doc_blocks.blocks() if doc_blocks.needs_gpu(src)]
README_BLOCKS = doc_blocks.FENCE.findall(doc_blocks.README.read_text())


def test_readme_has_examples():
    assert len(README_BLOCKS) >= 4


@pytest.mark.parametrize("label, src", BLOCKS, ids=[label for label, _ in BLOCKS])
def test_doc_example_runs(label, src):
    pytest.importorskip("torch")
    pytest.importorskip("cupy")
    import cgraw

    try:
        exec(compile(src, label, "exec"), {"__name__": "doc_example"})
    finally:
        cgraw.mark_step_begin()
        cgraw.reset()
