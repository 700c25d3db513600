"""torch's side of a graph tree's pool: who owns each MemPool block, checkpoints and restores.

Layer L7: torch's private API only through ``interop.torch.private_api`` (``tc`` below), so the CPU tier
can drive this with a model of torch's rules (``tests/unit/test_torch_checkpoint_model.py``).

torch's ``_cuda_setCheckpointPoolState`` frees every block of the pool, re-allocates the
checkpoint's, and then wants (a) one stale storage, holding the allocator's deleter, for each
block it freed for good, whose deleter it swaps for a no-op, and (b) storages without a deleter
context for the re-allocated blocks that should get one. Its restore is not atomic: it frees the
blocks before it validates, so a refusal after the call leaves blocks freed that their owners
will free a second time (``invalid device pointer``, a process abort). So ``plan_restore`` checks
everything torch will check first and raises ``RestoreRefused`` before anything changes: every
block allocated now must have a known owner, holding the deleter unless the block stays. A swapped
storage keeps its context and can never take a deleter back: a block on the path again gets a
fresh owner built from its pointer, as torch's own trees build replay outputs.
"""

from __future__ import annotations

import gc
import sys

from cgraw.errors import CgrawError
from cgraw.interop.torch import private_api
from cgraw.trees.frameworks import span_elements

CLONE_ALIGN = 16  # a cloned output's copy starts at this alignment of its storage's offsets (every dtype's size divides it)


class RestoreRefused(CgrawError):
    """A checkpoint restore was refused before anything changed: memory of the tree's pool is
    held by something the tree does not know."""


class TorchTreeState:
    """Owners of the blocks of a tree's torch MemPool (``pool``: an ``interop.torch.TorchPool``)."""

    def __init__(self, tc, pool, device_ordinal: int, torch_device):
        self.tc = tc
        self.pool = pool
        self.device = device_ordinal
        self.torch_device = torch_device
        # data pointer -> the storage holding the allocator's deleter for that block, for every
        # block of a recording (placeholders and owned outputs)
        self.owners: dict[int, object] = {}
        self.limbo: list = []  # owners in a state no restore accepts: kept, never freed twice
        # poison(t, msg): reading t's storage raises msg from now on (an output of an ended generation)
        self.poison = getattr(tc, "_set_storage_access_error_msg", None)  # None in the CPU model of torch

    @staticmethod
    def clone_out(tensors) -> None:
        """Move handed-out outputs to private copies (``config.generation_cloning``): the outputs
        over one storage are copied together, the bytes from the first's first element to the
        last's end, and each re-pointed into the copy with its own sizes and strides, so they keep
        their layouts and the aliasing among them (a view of another output stays a view of it)
        without copying more of the storage than they reach."""
        torch = sys.modules["torch"]
        groups: dict = {}
        for t in tensors:
            groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
        with torch.no_grad():
            for ts in groups.values():
                spans = [(t.storage_offset() * t.element_size(),
                          (t.storage_offset() + span_elements(t.shape, t.stride())) * t.element_size()) for t in ts]
                lo = min(a for a, _ in spans) // CLONE_ALIGN * CLONE_ALIGN
                hi = max(b for _, b in spans)
                raw = torch.empty(0, dtype=torch.uint8, device=ts[0].device).set_(ts[0].untyped_storage())
                copy = raw[lo:hi].clone().untyped_storage()
                for t, (a, _) in zip(ts, spans):
                    t.set_(copy, (a - lo) // t.element_size(), t.size(), t.stride())

    @classmethod
    def for_pool(cls, device_pool) -> "TorchTreeState":
        from cgraw.interop.torch.pools import torch_pool_for

        torch = sys.modules["torch"]
        ordinal = device_pool.device.ordinal
        return cls(private_api.api(), torch_pool_for(device_pool), ordinal, torch.device("cuda", ordinal))

    def checkpoint(self):
        """``(torch's state, blocks allocated at it)``."""
        return self.pool.checkpoint()

    def spans(self, tensors) -> list[tuple[int, int]]:
        """``(data pointer, bytes)`` of the storages of the torch tensors among ``tensors`` whose
        memory is in the pool, once each; a storage not yet an owner becomes its block's owner."""
        return storage_spans(tensors, self.pool.owner_of(), self.owners)

    def plan_restore(self, torch_ckpt, path_spans: list):
        """Everything the restore to ``torch_ckpt`` needs, checked; ``path_spans`` are the spans of
        the recordings on the path (their blocks stay). Raises ``RestoreRefused``; changes nothing.

        Blocks allocated now but not at the checkpoint are freed for good: each must have an
        owner holding the deleter, which goes stale. Blocks allocated at the checkpoint stay or
        come back: each keeps its owner or gets a new one, on the path or not (a block of a
        dropped recording that was alive at the checkpoint comes back too, and is then freed at
        a later restore through that owner instead of leaking).
        """
        _state, ckpt_alloc = torch_ckpt
        tc = self.tc
        has_deleter = tc._has_Standard_Deleter
        owners = self.owners
        current = self.pool.allocated()
        unknown = [p for p in current if p not in owners]
        if unknown:  # tensors that died in reference cycles may still hold them: collect, look again
            gc.collect()  # only then: a full collection costs tens of ms with torch's objects alive
            current = self.pool.allocated()
            unknown = [p for p in current if p not in owners]
        if unknown:
            raise RestoreRefused(
                f"{len(unknown)} block(s) of the tree's torch pool (first 0x{min(unknown):x}) are held by "
                "tensors the tree does not know, for example one a graphed function stored on an object "
                "while it was recorded")
        stale = []
        for p in current:
            if p not in ckpt_alloc:
                s = owners[p]
                if not has_deleter(s._cdata):
                    raise RestoreRefused(f"the owner of block 0x{p:x} no longer holds torch's deleter")
                stale.append(s)
        wanted = {p: n for spans in path_spans for p, n in spans}
        for p in wanted:
            if p not in ckpt_alloc:
                raise RestoreRefused(f"block 0x{p:x} of a recording on the path is not in the checkpoint")
        kept, adopted = {}, {}
        for p, n in ckpt_alloc.items():
            s = owners.get(p)
            if s is not None and p in current and has_deleter(s._cdata):
                kept[p] = s
            else:
                adopted[p] = tc._construct_storage_from_data_pointer(p, self.torch_device, wanted.get(p, n))
        return kept, stale, adopted, current

    def apply_restore(self, torch_ckpt, plan) -> None:
        state, _ = torch_ckpt
        kept, stale, adopted, current = plan
        try:
            self.tc._cuda_setCheckpointPoolState(self.device, state, [s._cdata for s in stale],
                                                 [s._cdata for s in adopted.values()])
        finally:
            # an owner neither kept nor freed for good (its block is not allocated now) lost its
            # deleter at an earlier restore; one that still held it would free a block twice:
            # keep it for good
            for p, s in self.owners.items():
                if p not in kept and p not in current and self.tc._has_Standard_Deleter(s._cdata):
                    self.limbo.append(s)
            kept.update(adopted)
            self.owners = kept


def storage_spans(objs, in_mempool, owners: dict) -> list[tuple[int, int]]:
    """``(data pointer, bytes)`` of the storages of the torch tensors among ``objs`` whose memory
    is in torch's MemPool (``in_mempool(ptr)``), once each; a storage not yet in ``owners`` is
    entered there as its block's owner."""
    from cgraw.trees.arrays import is_torch

    out, seen = [], set()
    for t in objs:
        if is_torch(t) and hasattr(t, "untyped_storage"):
            s = t.untyped_storage()
            p = s.data_ptr()
            if p and p not in seen and in_mempool(p):
                seen.add(p)
                out.append((p, s.nbytes()))
                owners.setdefault(p, s)
    return out
