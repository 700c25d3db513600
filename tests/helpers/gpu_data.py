"""Fresh random device data for the GPU tier (torch and CuPy, float32); the test module has
imported torch and CuPy (``pytest.importorskip``) before it calls these."""

from __future__ import annotations

import contextlib
import sys

import numpy as np

rng = np.random.default_rng()


def trand(*shape):
    """A torch tensor of standard normal values on the current CUDA device."""
    return sys.modules["torch"].randn(*shape, device="cuda")


def crand(*shape):
    """A CuPy float32 array of standard normal values, drawn on the host."""
    return sys.modules["cupy"].asarray(rng.standard_normal(shape).astype(np.float32))


@contextlib.contextmanager
def full_fp32():
    """TF32 off for cuDNN and matmuls while comparing with eager (cuDNN convolutions use TF32 by
    default on Hopper), so tolerances measure cgraw rather than TF32 rounding; restored after."""
    torch = sys.modules["torch"]
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old

