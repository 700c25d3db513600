"""Addresses CPython hands out again, for tests of identity keys (no framework needed)."""

from __future__ import annotations


def at_reused_address(free, old_id, make, tries=2000):
    """After ``free()``, an object ``make()`` returns at address ``old_id`` (CPython reuses a freed
    object's memory), or a fresh one when none lands there: then ``free`` did not free it."""
    hold = []  # made before free(): a new list would take a freed list's memory first
    free()
    for _ in range(tries):
        obj = make()
        if id(obj) == old_id:
            return obj
        hold.append(obj)
    return make()
