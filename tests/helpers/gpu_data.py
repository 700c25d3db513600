"""Fresh random device data for the GPU tier (torch and CuPy, float32); the test module has
imported torch and CuPy (``pytest.importorskip``) before it calls these."""

from __future__ import annotations

import sys

import numpy as np

rng = np.random.default_rng()


def trand(*shape):
    """A torch tensor of standard normal values on the current CUDA device."""
    return sys.modules["torch"].randn(*shape, device="cuda")


def crand(*shape):
    """A CuPy float32 array of standard normal values, drawn on the host."""
    return sys.modules["cupy"].asarray(rng.standard_normal(shape).astype(np.float32))
