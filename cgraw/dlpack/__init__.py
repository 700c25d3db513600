"""DLPack: the structures and capsules torch and CuPy exchange, and ``cgraw.Tensor``.

Owns: the DLPack C structures (``structs``), making and reading capsules of every version
(``capsules``), and ``Tensor``/``from_dlpack`` over device memory (``tensor``).

May import: ``errors``, ``_cuda``; ``tensor`` also ``runtime`` (device, stream, memory).
"""
