"""CPU tier: the snapshot of the Python state a call's arguments reach (``trees.input_plan``),
which the tree compares around a warm-up: a replay runs the device work alone, so a function that
changes that state cannot be replayed."""

from __future__ import annotations

import dataclasses

from cgraw.trees.input_plan import changed_argument, python_state, state_change_verdict


class Obj:
    def __init__(self):
        self.n = 1
        self.items = [1, 2]
        self.inner = {"a": [3]}


@dataclasses.dataclass
class DC:
    x: float = 1.0


def _changed(fn, *args, **kwargs):
    before = python_state(args, kwargs)
    fn(*args, **kwargs)
    return changed_argument(before, args, kwargs)


def test_changes_the_snapshot_sees():
    assert "argument 0 (list)" in _changed(lambda a: a.append(1), [])
    assert "argument 0 (Obj)" in _changed(lambda o: setattr(o, "n", 2), Obj())
    assert "argument 0 (Obj)" in _changed(lambda o: o.items.append(3), Obj())
    assert "argument 0 (Obj)" in _changed(lambda o: o.inner["a"].pop(), Obj())
    assert "argument 0 (Obj)" in _changed(lambda o: setattr(o, "new", 0), Obj())
    assert "argument 'd'" in _changed(lambda d: d.update(k=1), d={})
    assert "argument 1 (DC)" in _changed(lambda a, b: setattr(b, "x", 2.0), 0, DC())
    replaced = Obj()
    assert _changed(lambda o: setattr(o, "items", [1, 2]), replaced) is not None  # equal, but another list


def test_what_leaves_the_snapshot_unchanged():
    assert _changed(lambda o: o.items.__setitem__(0, 1), Obj()) is None  # the same value written back
    assert _changed(lambda o: getattr(o, "n"), Obj()) is None
    assert _changed(lambda x, o: None, 3.0, Obj()) is None
    assert _changed(lambda o: setattr(o, "f", float("nan")), _nan_holder()) is None  # NaN for NaN
    assert python_state((), {}) is None
    assert changed_argument(None, (), {}) is None


def _nan_holder():
    o = Obj()
    o.f = float("nan")
    return o


def test_cycles_and_deep_nesting_end():
    a: list = []
    a.append(a)
    deep = cur = []
    for _ in range(50):
        nxt: list = []
        cur.append(nxt)
        cur = nxt
    assert python_state((a, deep), {}) == python_state((a, deep), {})
    cur.append(1)  # below the depth the snapshot follows
    assert _changed(lambda x: None, deep) is None


def test_the_first_change_warms_up_again_and_the_second_makes_the_function_eager():
    class Fn:
        unsafe_reason = None

    fn = Fn()
    assert state_change_verdict(fn, None, None) == (None, False)
    assert state_change_verdict(fn, "host sync", "changed") == ("host sync", False)  # the warm-up's own reason first
    assert state_change_verdict(fn, None, "changed") == (None, True)
    assert fn.unsafe_reason is None
    assert state_change_verdict(fn, None, "changed") == ("changed", False)
    assert fn.unsafe_reason == "changed"


def _followed(snap) -> int:
    """Containers and objects a snapshot followed (entries ``(type, id, ...)``)."""
    if isinstance(snap, list):  # python_state's list of per-argument snapshots
        return sum(_followed(s) for s in snap)
    if not isinstance(snap, tuple):
        return 0
    own = 1 if len(snap) >= 3 and isinstance(snap[0], type) and isinstance(snap[1], int) else 0
    return own + sum(_followed(s) for s in snap)


def test_a_wide_and_deep_argument_is_snapshot_within_a_budget():
    """A dict of 200 lists of 200 objects (40,000 objects and more inside them): the snapshot
    follows at most ``_BUDGET`` of them, so a warm-up stays cheap, and a change among the first it
    follows is still seen."""
    from cgraw.trees import input_plan

    wide = {k: [Obj() for _ in range(200)] for k in range(200)}
    assert _followed(python_state((wide,), {})) <= input_plan._BUDGET
    assert _changed(lambda d: d[0][0].items.append(1), wide) is not None
