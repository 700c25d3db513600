"""Data-parallel steps over NCCL, one process per GPU (worker in benchmarks/dp_step.py).

world_size=1 runs on any GPU machine (a one-rank NCCL group); world_size=2 needs two GPUs of one
host and skips, saying so, where fewer are present. For each rank and each variant (torch
``torch.distributed`` MLP step, CuPy ``NcclCommunicator`` linear-regression step): 20 steps of a
graphed step against the eager one, with fresh random batches per rank and step.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
pytest.importorskip("cupy")


@pytest.mark.parametrize("world_size", [1, 2])
def test_data_parallel_step_matches_eager(world_size):
    if not torch.distributed.is_nccl_available():
        pytest.fail("torch was built without NCCL")
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs of one host; this machine has {torch.cuda.device_count()}")
    from benchmarks import dp_step

    results = dp_step.run_ranks(world_size, steps=20)
    assert [r["rank"] for r in results] == list(range(world_size))
    for variant in ("torch", "cupy"):
        per_rank = [r[variant] for r in results]
        for v in per_rank:
            assert "unavailable" not in v, v.get("unavailable")
            assert v["eager_calls"] == 0 and not v["skip_reasons"], v["skip_reasons"]
            assert v["warmups"] == 1 and v["recordings"] == 1 and v["replays"] == 18
            assert v["loss_max_abs_diff"] <= 1e-5, (variant, v["loss_max_abs_diff"])
            assert v["param_max_abs_diff"] <= 1e-5, (variant, v["param_max_abs_diff"])
        # every rank applied the same all-reduced gradients: identical parameters
        for v in per_rank[1:]:
            assert v["params"] == per_rank[0]["params"], variant
