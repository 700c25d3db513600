"""Keep ``CGRAW_GC_STRESS=1`` runs affordable: a stress collection costs what the test allocated.

Under the stress mode cgraw collects garbage (``gc.collect()``, every generation) at each capture
boundary and in each allocation a capture routes. A process that imported torch, transformers and
timm tracks about 450,000 objects and a full collection takes 80-230 ms, so the tier did not finish
in 10 minutes. ``settle()`` collects everything and then freezes the survivors (``gc.freeze()``):
objects that were alive before the test started are left out of the test's stress collections,
while every object the test creates, and every cycle it leaves behind, is still collected at each
stress point. The next ``settle()`` unfreezes first, so nothing frozen is leaked for good.
"""

from __future__ import annotations

import gc

from cgraw._cuda import defer


def settle() -> None:
    """Collect, then freeze what survived; a no-op unless ``CGRAW_GC_STRESS`` is set."""
    if not defer.CGRAW_GC_STRESS:
        return
    gc.unfreeze()
    gc.collect()
    gc.freeze()
