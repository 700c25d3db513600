"""Test policy: GPU tests skip without a device, and fail instead when CGRAW_REQUIRE_GPU=1.

Shared fixtures live here; importable helpers live in tests/helpers/.
"""

from __future__ import annotations

import gc
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))

REQUIRE_GPU = os.environ.get("CGRAW_REQUIRE_GPU", "").strip().lower() in ("1", "true", "yes", "on")
POOL_CAP = 8 << 30


def _gpu_probe() -> tuple[bool, str]:
    from cgraw import _cuda

    return _cuda.driver_available()


def pytest_collection_modifyitems(config, items):
    gpu_items = [it for it in items if it.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    ok, reason = _gpu_probe()
    if ok or REQUIRE_GPU:
        return  # with CGRAW_REQUIRE_GPU=1 a missing device fails the tests loudly
    skip = pytest.mark.skip(reason=f"no CUDA device: {reason} (set CGRAW_REQUIRE_GPU=1 to fail instead)")
    for it in gpu_items:
        it.add_marker(skip)


@pytest.fixture(scope="session")
def device():
    import cgraw

    return cgraw.Device(0).set_current()


@pytest.fixture
def stream(device):
    import cgraw

    s = cgraw.Stream.create(device)
    yield s
    s.synchronize()
    s.close()


@pytest.fixture
def pool(device):
    """A capped DevicePool; teardown asserts no block leaked, then returns memory to the driver."""
    import cgraw

    p = cgraw.DevicePool(device, limit=POOL_CAP, name="test")
    yield p
    gc.collect()
    device.synchronize()
    live = p.stats().live_blocks
    p.close()
    assert live == 0, f"pool leaked {live} block(s)"


@pytest.fixture
def torch_mod():
    return pytest.importorskip("torch")


@pytest.fixture
def cupy_mod():
    return pytest.importorskip("cupy")


@pytest.fixture
def saved_config():
    """``cgraw.config`` (graphed functions' settings) put back as it was after the test."""
    import dataclasses

    from cgraw.trees.config import config

    saved = dataclasses.asdict(config)
    yield config
    for k, v in saved.items():
        setattr(config, k, v)
