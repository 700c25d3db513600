"""CuPy adapter: run CuPy on the capture stream with its allocations from a cgraw pool.

Layer L5: CuPy is only used when the user has imported it. Allocations go through
``cupy.cuda.using_allocator`` (thread-local) to ``DevicePool.cupy_allocator``; the capture stream
is made CuPy's current stream with ``cupy.cuda.ExternalStream``. Both are undone after the capture.
"""

from __future__ import annotations

import sys
import warnings

HOST_SYNC = (
    "host synchronisation is not capturable: .get(), .item(), cupy.asnumpy(), printing a device "
    "value and Stream.synchronize() wait for the GPU, which a graph cannot do; move them out of the "
    "captured region"
)
CUBLAS = (
    "CuPy refuses every cuBLAS call during stream capture (matmul, dot, @, einsum, tensordot): "
    "'calling cuBLAS API during stream capture is currently unsupported'; do the matrix product with "
    "torch inside the capture (torch.from_dlpack / cupy.from_dlpack are zero-copy), or outside it"
)


def _external_stream(cupy, stream, dev: int):
    """CuPy's view of a cgraw stream: ``Stream.from_external`` (CuPy 14, via ``__cuda_stream__``),
    else the older ``ExternalStream``."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        try:
            return from_external(stream)
        except TypeError:
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(stream.ptr, dev)


def cupy_module():
    return sys.modules.get("cupy")


class CupyRouting:
    """Brackets a capture for CuPy: allocator hook and current stream."""

    def __init__(self, pool, stream, owners: list):
        self.cupy = sys.modules["cupy"]
        self.pool = pool
        self.stream = stream
        self.owners = owners
        self._alloc_ctx = None
        self._stream_ctx = None

    def producer_streams(self) -> list[int]:
        return [int(self.cupy.cuda.get_current_stream().ptr)]

    def enter(self) -> None:
        cupy = self.cupy
        dev = self.pool.device.ordinal
        self._alloc_ctx = cupy.cuda.using_allocator(self.pool.cupy_allocator(self.owners))
        self._alloc_ctx.__enter__()
        try:
            self._stream_ctx = _external_stream(cupy, self.stream, dev)
            self._stream_ctx.__enter__()
        except BaseException:
            self.exit()
            raise

    def exit(self) -> None:
        try:
            if self._stream_ctx is not None:
                self._stream_ctx.__exit__(None, None, None)
        finally:
            self._stream_ctx = None
            if self._alloc_ctx is not None:
                ctx, self._alloc_ctx = self._alloc_ctx, None
                ctx.__exit__(None, None, None)

    @staticmethod
    def classify(exc: BaseException) -> str | None:
        msg = str(exc)
        if "cuBLAS API during stream capture" in msg:
            return CUBLAS
        if ("cudaErrorStreamCapture" in msg or "operation not permitted when stream is capturing" in msg
                or "stream is capturing" in msg):
            return HOST_SYNC
        return None
