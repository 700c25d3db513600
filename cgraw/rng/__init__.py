"""Graph-safe random numbers: draws inside graphs that follow torch's and CuPy's own generators.

Owns: the pure design (``plan``: generator records, per-graph draws, the host's mirror), the
CUDA C of the Philox kernels and rejection samplers (``philox.cu``, ``samplers.cu``, ``fills.cu``,
``records.cu``, put together per kernel by ``kernels``), the records and kernel launches on the
device (``device``), and the NumPy oracle the kernels are tested against (``reference``).

May import: ``errors``, ``_cuda``, ``runtime.device``. torch and CuPy reach it through
``interop.torch.rng`` and ``interop.cupy.rng``; it imports neither.
"""
