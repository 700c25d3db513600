"""cgraw: CUDA graphs for ordinary torch and CuPy code, in pure Python on cuda-python.

Importing cgraw makes no CUDA call: the driver is loaded on first use, and a machine without
one gets a single ``cgraw.CudaUnavailableError``.
"""

from cgraw.runtime.capture import capture
from cgraw.runtime.device import Device
from cgraw.errors import (
    AllocatorError,
    CaptureError,
    CgrawError,
    ControlFlowError,
    CudaError,
    CudaUnavailableError,
    InvalidFree,
    OutOfMemoryError,
    PoolClosed,
    PoolExhausted,
    ResourceLeakWarning,
    SnapshotMismatch,
    TreeError,
)
from cgraw.runtime.graph import Graph, NodeInfo
from cgraw.trees.graphed import (
    GraphedFunction,
    graphed,
    mark_static,
    mark_step_begin,
    report,
    reset,
    tree_text,
    unsafe,
)
from cgraw.trees.callables import make_graphed_callables
from cgraw.runtime.memory import DevicePool
from cgraw.runtime.stream import Event, Stream
from cgraw.dlpack.tensor import Tensor, from_dlpack
from cgraw.trees.config import config
from cgraw.control.flow import cond, while_loop

__version__ = "0.1.0"

__all__ = [
    "AllocatorError",
    "CaptureError",
    "CgrawError",
    "ControlFlowError",
    "CudaError",
    "CudaUnavailableError",
    "Device",
    "DevicePool",
    "Event",
    "Graph",
    "GraphedFunction",
    "InvalidFree",
    "NodeInfo",
    "OutOfMemoryError",
    "PoolClosed",
    "PoolExhausted",
    "ResourceLeakWarning",
    "SnapshotMismatch",
    "Stream",
    "Tensor",
    "TreeError",
    "capture",
    "cond",
    "config",
    "from_dlpack",
    "graphed",
    "make_graphed_callables",
    "mark_static",
    "mark_step_begin",
    "report",
    "reset",
    "tree_text",
    "unsafe",
    "while_loop",
]

_SEEDING = ("graphs draw from torch's and CuPy's own generators, as eager code does: seed them with "
            "torch.manual_seed(s) (or torch.cuda.manual_seed_all) and cupy.random.seed(s)")


def __getattr__(name: str):
    if name in ("manual_seed", "initial_seed"):
        raise AttributeError(f"cgraw has no {name}: {_SEEDING}")
    raise AttributeError(f"module 'cgraw' has no attribute {name!r}")
