"""CPU tests of the tree's torch checkpoint bookkeeping (``interop.torch.checkpoints.TorchTreeState``)
against a model of torch's ``_cuda_setCheckpointPoolState`` rules.

The model (``FakeTorchC``) keeps the set of allocated blocks of one MemPool and enforces what
torch 2.11's Module.cpp and CUDACachingAllocator enforce:
- the restore frees every allocated block and re-allocates the checkpoint's;
- there must be at least as many (distinct) stale storages as blocks freed for good
  ("Any stale tensors which are being manually freed must be passed to set checkpoint");
- a stale storage's block must be among the freed ones, and it must hold the allocator's deleter,
  which is swapped for a no-op ("Unexpected deleter function on storage");
- a storage to get a deleter must have no deleter context (" Not expecting deleter function");
  a swapped storage keeps its context;
- a storage holding the allocator's deleter frees its block when it dies, and that block must be
  allocated ("invalid device pointer").
A random walk over a tree of recordings (record under an anchor, go back to another node,
discard a subtree) then checks that every restore is accepted and that the allocator's allocated
blocks are exactly those of the recordings on the path plus the ones no restore has reclaimed yet.
"""

from __future__ import annotations

import gc
import random
import weakref

import pytest

from cgraw.interop.torch.checkpoints import RestoreRefused, TorchTreeState, storage_spans


class ModelError(RuntimeError):
    pass


class FakeStorage:
    """A StorageImpl: a block pointer, a deleter ("std", "nothing" or None) and a context flag."""

    def __init__(self, model, ptr: int, nbytes: int, deleter, ctx: bool):
        self.ptr, self._nbytes, self.ctx = ptr, nbytes, ctx
        self._cell = {"deleter": deleter}  # shared with the finalizer, which runs at death
        self._cdata = id(self)
        model.storages[self._cdata] = self
        weakref.finalize(self, model._died, ptr, self._cell)

    @property
    def deleter(self):
        return self._cell["deleter"]

    @deleter.setter
    def deleter(self, value):
        self._cell["deleter"] = value

    def data_ptr(self) -> int:
        return self.ptr

    def nbytes(self) -> int:
        return self._nbytes


class FakeTensor:
    """What ``_storage_spans`` looks at: a torch-module type with ``untyped_storage()``."""

    __module__ = "torch.fake"

    def __init__(self, storage):
        self._s = storage

    def untyped_storage(self):
        return self._s

    def data_ptr(self) -> int:
        return self._s.ptr


class FakeTorchC:
    def __init__(self):
        self.allocated: set[int] = set()
        self.storages = weakref.WeakValueDictionary()
        self.deaths: list[str] = []  # errors raised by deleters (a destructor cannot raise)
        self.next_ptr = 0x1000

    # the allocator
    def malloc(self, nbytes: int) -> FakeStorage:
        # reuse the lowest free address, as a caching allocator reuses freed blocks
        p = 0x1000
        while p in self.allocated:
            p += 0x1000
        self.allocated.add(p)
        return FakeStorage(self, p, nbytes, "std", True)

    def _died(self, ptr, cell) -> None:
        if cell["deleter"] == "std":
            if ptr not in self.allocated:
                self.deaths.append(f"invalid device pointer 0x{ptr:x}")
            self.allocated.discard(ptr)

    # torch._C functions the backend calls
    def _has_Standard_Deleter(self, cdata: int) -> bool:
        return self.storages[cdata].deleter == "std"

    def _construct_storage_from_data_pointer(self, ptr: int, device, nbytes: int):
        return FakeStorage(self, ptr, nbytes, None, False)

    def _cuda_getCheckpointState(self, device, pool_id):
        return frozenset(self.allocated)

    def _cuda_setCheckpointPoolState(self, device, state, stale, live) -> None:
        stale_set = []
        for c in stale:
            if c not in stale_set:
                stale_set.append(c)
        freed = set(self.allocated)
        self.allocated = set(state)
        definite = len(freed - self.allocated)
        if len(stale_set) < definite:
            raise ModelError("Any stale tensors which are being manually freed must be passed to set checkpoint")
        for c in stale_set:
            s = self.storages[c]
            if s.ptr not in freed:
                raise ModelError("stale storage's block was not freed")
            if s.deleter != "std":
                raise ModelError("Unexpected deleter function on storage, could not swap function")
            s.deleter = "nothing"
        for c in live:
            s = self.storages[c]
            if s.ptr in self.allocated:
                if s.ctx:
                    raise ModelError(" Not expecting deleter function")
                s.deleter = "std"
                s.ctx = True


class FakeTorchPool:
    """``interop.torch.TorchPool`` over the model: its allocated blocks and checkpoints."""

    def __init__(self, private_api: FakeTorchC):
        self.torch_c = private_api

    def allocated(self) -> dict:
        return {p: 512 for p in self.torch_c.allocated}

    def checkpoint(self):
        return self.torch_c._cuda_getCheckpointState(0, None), self.allocated()

    def owner_of(self):
        return lambda p: True


class _Backend:
    """The restore as ``CudaBackend.restore`` drives it: plan (all checks), then apply."""

    def __init__(self, private_api: FakeTorchC):
        self.tts = TorchTreeState(private_api, FakeTorchPool(private_api), 0, "cuda:0")

    @property
    def _owners(self):
        return self.tts.owners

    @_owners.setter
    def _owners(self, value):
        self.tts.owners = value

    def _restore_torch(self, ckpt, on_path) -> None:
        plan = self.tts.plan_restore(ckpt, [r.spans for r in on_path])
        self.tts.apply_restore(ckpt, plan)


def _backend(private_api: FakeTorchC) -> _Backend:
    return _Backend(private_api)


class Rec:
    """A recording as the restore sees it: ``spans`` and what keeps its tensors alive."""

    def __init__(self, parent, tensors, spans, state):
        self.parent, self.keep, self.spans, self.state = parent, tensors, spans, state

    def path(self):
        out, n = [], self
        while n is not None:
            out.append(n)
            n = n.parent
        return out


def _record(private_api, backend, parent, rng) -> Rec:
    tensors = [FakeTensor(private_api.malloc(rng.choice((512, 4096, 1 << 20)))) for _ in range(rng.randint(1, 4))]
    if parent is not None and rng.random() < 0.3:
        tensors.append(parent.keep[0])  # an output that is the parent's (a returned input)
    spans = storage_spans(tensors, lambda p: True, backend._owners)
    return Rec(parent, tensors, spans, backend.tts.checkpoint())


def _walk(seed: int, steps: int) -> None:
    rng = random.Random(seed)
    private_api = FakeTorchC()
    backend = _backend(private_api)
    root_state = backend.tts.checkpoint()
    recs: list[Rec] = []
    at = None  # the node whose checkpoint the allocator equals (None: the root, "?" unknown)
    for _ in range(steps):
        op = rng.random()
        if op < 0.15 and recs:  # re-record: a node's subtree goes
            victim = rng.choice(recs)
            recs = [r for r in recs if victim not in r.path()]
            if at is not None and at not in recs:
                at = "?"
            continue
        anchor = rng.choice([None, *recs]) if recs else None
        if at is not anchor:
            on_path = [] if anchor is None else anchor.path()
            backend._restore_torch(root_state if anchor is None else anchor.state, on_path)
            at = anchor
            # the allocator holds the path's blocks, plus at most blocks of dead recordings
            # that are still owned (freed at the next restore)
            wanted = {p for r in on_path for p, _ in r.spans}
            assert wanted <= private_api.allocated
            # every block of the path has exactly one owner holding the allocator's deleter
            for p in wanted:
                owner = backend._owners[p]
                assert owner.deleter == "std" and owner.ptr == p
        rec = _record(private_api, backend, anchor, rng)
        recs.append(rec)
        at = rec
        gc.collect()
        assert not private_api.deaths, private_api.deaths
    # dropping everything frees every owned block exactly once
    recs.clear()
    backend._owners = {}
    gc.collect()
    assert not private_api.deaths, private_api.deaths


@pytest.mark.parametrize("seed", range(16))
def test_random_tree_walk_restores_are_accepted(seed):
    _walk(seed, 50)


def test_branch_back_and_forth():
    """A -> B, back to A -> C, back to B's child: B's storages were made stale by the first
    restore and are on the path again (torch's 'Not expecting deleter function' case)."""
    private_api = FakeTorchC()
    backend = _backend(private_api)
    root = backend.tts.checkpoint()
    rng = random.Random(0)
    a = _record(private_api, backend, None, rng)
    b = _record(private_api, backend, a, rng)
    backend._restore_torch(a.state, a.path())
    c = _record(private_api, backend, a, rng)
    backend._restore_torch(b.state, b.path())
    d = _record(private_api, backend, b, rng)
    backend._restore_torch(c.state, c.path())
    backend._restore_torch(d.state, d.path())
    backend._restore_torch(root, [])
    assert private_api.allocated == set()
    gc.collect()
    assert not private_api.deaths


def test_model_rejects_reviving_a_stale_storage():
    """The model is strict where torch is: giving a swapped storage its deleter back fails."""
    private_api = FakeTorchC()
    s = private_api.malloc(512)
    empty = frozenset()
    state = frozenset({s.ptr})
    private_api._cuda_setCheckpointPoolState(0, empty, [s._cdata], [])
    with pytest.raises(ModelError, match="Not expecting deleter"):
        private_api._cuda_setCheckpointPoolState(0, state, [], [s._cdata])
    with pytest.raises(ModelError, match="Any stale tensors"):
        private_api._cuda_setCheckpointPoolState(0, empty, [], [])


def test_a_block_held_outside_the_tree_refuses_the_restore_before_anything_changes():
    """A graphed function stashed a tensor while it was recorded: its block is allocated but
    owned by nobody the tree knows. torch would free it and then refuse (a double free later);
    the plan refuses first, and the model's state and every owner are untouched."""
    private_api = FakeTorchC()
    backend = _backend(private_api)
    root = backend.tts.checkpoint()
    rng = random.Random(1)
    a = _record(private_api, backend, None, rng)
    stash = FakeTensor(private_api.malloc(512))  # allocated during a's recording, unknown to the tree
    b = _record(private_api, backend, a, rng)
    before = (set(private_api.allocated), dict(backend._owners), [o.deleter for o in backend._owners.values()])
    with pytest.raises(RestoreRefused, match="held by tensors the tree does not know"):
        backend._restore_torch(a.state, a.path())
    assert (set(private_api.allocated), dict(backend._owners),
            [o.deleter for o in backend._owners.values()]) == before
    with pytest.raises(RestoreRefused):
        backend._restore_torch(root, [])
    # dropping everything (the tree starting over on a fresh pool) frees each block once
    del a, b, stash, before
    backend._owners = {}
    gc.collect()
    assert not private_api.deaths, private_api.deaths
    assert private_api.allocated == set()


def test_a_block_held_by_a_dead_reference_cycle_is_collected_and_a_clean_restore_collects_nothing(monkeypatch):
    """plan_restore collects garbage only when a block has no known owner (a full collection
    costs tens of ms with torch's objects alive): then a tensor that died in a reference cycle
    lets its block go and the restore goes ahead."""
    import types

    from cgraw.interop.torch import checkpoints as torch_tree

    collections = []
    monkeypatch.setattr(torch_tree, "gc", types.SimpleNamespace(collect=lambda: collections.append(1) or gc.collect()))
    private_api = FakeTorchC()
    backend = _backend(private_api)
    rng = random.Random(2)
    a = _record(private_api, backend, None, rng)
    _record(private_api, backend, a, rng)
    backend._restore_torch(a.state, a.path())
    assert collections == []  # every block had an owner: no collection
    gc.disable()
    try:
        cycle = [FakeTensor(private_api.malloc(512))]  # made during a recording, then dead in a cycle
        cycle.append(cycle)
        del cycle
        backend._restore_torch(a.state, a.path())
    finally:
        gc.enable()
    assert collections == [1]
    gc.collect()
    assert not private_api.deaths, private_api.deaths


def test_a_path_block_missing_from_the_checkpoint_is_refused():
    private_api = FakeTorchC()
    backend = _backend(private_api)
    rng = random.Random(2)
    a = _record(private_api, backend, None, rng)
    early = backend.tts.checkpoint()  # taken before b allocated anything
    b = _record(private_api, backend, a, rng)
    with pytest.raises(RestoreRefused, match="not in the checkpoint"):
        backend._restore_torch(early, b.path())
    assert not private_api.deaths


def test_cloned_out_outputs_keep_their_layouts_and_aliasing_and_copy_only_what_they_reach():
    """``generation_cloning="user_visible"``: outputs over one storage are copied together and
    re-pointed into the copy, so a view of another output stays its view, every output keeps its
    sizes, strides and values, and a row of a large buffer takes a copy of its own bytes, not the
    buffer's; the tree's memory is no longer theirs."""
    torch = pytest.importorskip("torch")
    a = torch.randn(4, 4)
    big = torch.randn(1000, 4)
    outs = [a, a.t(), a[1:, ::2], big[3], torch.randn(1, 4).expand(5, 4), torch.empty(0, 3)]
    before = [(t.clone(), t.stride(), t.shape) for t in outs]
    old_ptrs = [t.untyped_storage().data_ptr() for t in outs]
    TorchTreeState.clone_out(outs)
    for t, (values, stride, shape), ptr in zip(outs, before, old_ptrs):
        assert torch.equal(t, values) and t.stride() == stride and t.shape == shape
        assert t.numel() == 0 or t.untyped_storage().data_ptr() != ptr
    a, at, sub, row = outs[:4]
    assert at.untyped_storage().data_ptr() == a.untyped_storage().data_ptr() == sub.untyped_storage().data_ptr()
    a[1, 0] = 7.0  # still views of one another
    assert at[0, 1] == 7.0 and sub[0, 0] == 7.0
    assert row.untyped_storage().nbytes() <= 16 + 4 * 4  # its 16 bytes (from a 16-byte boundary), not 16 KB
