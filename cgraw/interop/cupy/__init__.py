"""CuPy: running CuPy inside captures, imported only once the user has imported CuPy.

Owns: CuPy on the capture stream with its allocations from a pool (``pools``), host uploads staged
through an arena (``staging``), ``cupy.random`` on cgraw's Philox kernels (``rng``), masked
assignment without a host read (``mask``), and cuBLAS, cuSOLVER and cuSPARSE calls on
cgraw-owned handles (``blas``, ``solver``, ``sparse``, over ``route``).

May import: ``errors``, ``_cuda``, ``runtime``, ``rng``.
"""
