"""Environment flags, read once at import.

Layer L0: stdlib only.
"""

from __future__ import annotations

import os


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


CGRAW_DEBUG = _flag("CGRAW_DEBUG")
CGRAW_REQUIRE_GPU = _flag("CGRAW_REQUIRE_GPU")
# Test mode: gc.collect() at every capture boundary and in every allocation made while a capture
# routes allocations, so finalizers (graphs, pools, torch MemPools) fire at the worst moments.
CGRAW_GC_STRESS = _flag("CGRAW_GC_STRESS")
