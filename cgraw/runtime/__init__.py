"""The CUDA runtime objects: ``Device``, ``Stream``, ``Event``, ``DevicePool``, ``Graph`` and ``capture()``.

Owns: devices and their primary contexts (``device``), streams and events (``stream``), the
device-memory pool over ``allocator/`` (``memory``), instantiated graphs and their launch
(``graph``), and driver stream capture with torch's and CuPy's allocations and streams routed
into a pool (``capture``).

May import: ``errors``, ``_cuda`` (every driver call), ``allocator``, ``dlpack``; ``capture`` also
the framework adapters of ``interop`` that route a capture. Never ``trees``.
"""
