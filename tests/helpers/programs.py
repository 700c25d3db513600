"""Random programs of graphed functions, and an interpreter that runs them graphed or eagerly.

The differential random walk. ``generate(seed)`` draws a *program*: 3 to 6
small functions over arrays of one shape, each tagged "torch", "cupy" or "mixed" (a mixed one
moves its value to the other framework with ``from_dlpack``, zero-copy, in the middle of its
body; every program has at least one function that takes one framework and returns the other),
a successor table and the parameters of a walk. Programs are kept small enough (at most 16 tree
nodes, each reached in at least 1 step of 20) that a walk records every node within a few
hundred calls; ``node_probabilities`` gives the tree. ``run`` walks the program: each *step*
calls a root function on fresh inputs (or on the previous step's last output: ``h = f(h)``),
then 1 to 3 more functions, each consuming the previous output (a tree output) and, for
two-argument functions, a fresh eager input. Which function follows is a host-side branch on a
host copy of the previous output, the call counter and the walk's seeded RNG; a step sometimes
begins with an explicit ``mark_step_begin()``; outputs are sometimes kept and read again later,
in the same step (they must still hold their values) or after it (a torch output in the tree's
memory must then raise "overwritten by a subsequent run"; one the tree does not own, such as a
warm-up's output, which is ordinary memory, must still hold its value; a CuPy output is never
poisoned and is not read).

The module imports neither torch nor CuPy: ``run`` gets a namespace whose ``torch`` and ``cupy``
attributes implement a small set of operations (``TorchOps``/``CupyOps`` over the real modules,
``NumpyOps`` on the CPU, or a test's own fake). Every operation is elementwise and bitwise
deterministic (no matmul, reduction, RNG or host synchronisation inside functions), so a graphed
run and an eager run of the same program must produce the same bits, call by call:
``compare(graphed_result, eager_result)`` lists the differences.

Semantics the walk respects (cgraw's graph trees, see README "Graph trees"):
- every step is a generation: it starts with ``mark_step_begin()`` or with a call of a root
  function (the inference rule). A root function's first root call always follows an explicit
  ``mark_step_begin()``: otherwise the tree would take it for a child of the previous step's last
  node (it is not yet known as a root) and the path would keep growing;
- root functions are never called inside a chain, and chain functions never start a step;
- a torch output is never passed as an input after a generation boundary, except as ``h = f(h)``
  into the root call that begins the next generation by the inference rule (no explicit mark);
  a CuPy output (never poisoned) may also be passed so after an explicit mark: nothing has run
  since, so it still holds its values;
- a mutating function adds in place only to its first argument, which is always the previous
  call's output (a tree output), never to an eager input.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

SHAPES = ((64,), (33, 7), (256,), (16, 16), (3, 5, 7))
TAGS = ("torch", "cupy", "mixed")
FRAMEWORKS = ("torch", "cupy")
DTYPE = np.float32
CONSTS = (0.5, 0.75, 1.25, 1.5, -0.5, -1.25, 0.25, 2.0, -2.0)
BODY_OPS = ("mul", "addc", "add", "mul_arg", "abs", "where_gt", "sin", "tanh", "exp_clamp")
SQUASH_OPS = ("tanh", "sin", "exp_clamp")  # the last op of every function: keeps values bounded
BINARY_OPS = ("add", "mul_arg", "where_gt")  # may read the second argument
CLAMP = (-3.0, 2.0)  # exp_clamp: exp(clamp(x, -3, 2)) <= 7.4

RAISED = "raised-overwritten"  # log value: reading this output raised, as expected
NOT_READ = "not-read"  # log value: a CuPy output kept across a generation (not poisoned, not read)
OVERWRITTEN = "overwritten by a subsequent run"  # what reading a poisoned torch output raises


# ---------------------------------------------------------------------- programs


@dataclass(frozen=True)
class Op:
    """One elementwise operation on the current value ``v`` (``b``: the second argument)."""

    name: str  # one of BODY_OPS
    const: float = 0.0
    use_arg: bool = False  # binary ops: the other operand is the second argument (else ``v``)


@dataclass(frozen=True)
class FnSpec:
    """One function of a program."""

    name: str
    tag: str  # "torch", "cupy" or "mixed"
    in_fw: str  # framework of its arguments
    out_fw: str  # framework of its result
    n_args: int  # 1 or 2; the second argument is always a fresh eager input
    in_shape: tuple
    out_shape: tuple
    ops: tuple  # of Op, 2 to 5; the last is one of SQUASH_OPS
    switches: tuple  # op indices before which the value (and ``b``) moves to the other framework
    mutates: bool  # adds in place to its first argument (a tree output) before the ops
    mutate_const: float  # what it adds: this constant, or the second argument if mutate_arg
    mutate_arg: bool
    is_root: bool
    succ: tuple  # (next function when the branch is False, ... when True); non-root names

    def frameworks_along(self) -> list[str]:
        """The framework each op runs in."""
        fw, out = self.in_fw, []
        for k in range(len(self.ops)):
            if k in self.switches:
                fw = _other(fw)
            out.append(fw)
        return out


@dataclass(frozen=True)
class Program:
    seed: int
    shape: tuple
    functions: tuple  # of FnSpec; roots first
    roots: tuple  # names
    p_mark: float  # an explicit mark_step_begin() before a step's root call
    p_recurrent: float  # the root consumes the previous step's last output (h = f(h))
    p_keep: float  # an output is kept and read again later
    p_flip: float  # the seeded RNG flips the data-dependent branch (0.5: each branch is taken
    # with probability 1/2 whatever the data, so every path gets recorded early; the branch still
    # depends on the data: with other data the same coin takes the other branch)
    lengths: tuple  # calls per step, drawn uniformly from these

    def fn(self, name: str) -> FnSpec:
        for f in self.functions:
            if f.name == name:
                return f
        raise KeyError(name)

    def describe(self) -> str:
        head = (f"program seed={self.seed} shape={self.shape} roots={list(self.roots)} "
                f"p_mark={self.p_mark} p_recurrent={self.p_recurrent} p_keep={self.p_keep} "
                f"lengths={self.lengths}")
        lines = [head]
        for f in self.functions:
            ops = " ".join(f"{o.name}{'(b)' if o.use_arg else ''}" + (f"[{o.const}]" if o.const else "")
                           for o in f.ops)
            lines.append(f"  {f.name} [{f.tag} {f.in_fw}->{f.out_fw}, {f.n_args} arg(s)"
                         f"{', mutates' if f.mutates else ''}{', switch at ' + str(f.switches) if f.switches else ''}]"
                         f" {ops} -> {f.succ[0]} / {f.succ[1]}")
        return "\n".join(lines)


def _other(fw: str) -> str:
    return "cupy" if fw == "torch" else "torch"


def generate(seed: int) -> Program:
    """A random valid program, the same for the same seed."""
    rng = random.Random(seed)
    for _ in range(1000):
        prog = _draw(rng, seed)
        if not problems(prog):
            return prog
    raise RuntimeError(f"no valid program drawn for seed {seed}")


def _draw(rng: random.Random, seed: int) -> Program:
    n = rng.randint(3, 6)
    n_roots = 1 if n == 3 else rng.choice((1, 2, 2))  # two roots are rejected more often
    shape = rng.choice(SHAPES)
    # chain (non-root) functions first: their input frameworks are what every output must be in
    chain = []
    for _ in range(n - n_roots):
        tag = rng.choice(TAGS)
        in_fw = rng.choice(FRAMEWORKS) if tag == "mixed" else tag
        chain.append([tag, in_fw])
    accepted = sorted({c[1] for c in chain})
    for c in chain:
        tag, in_fw = c
        c.append(in_fw if tag != "mixed" else rng.choice(accepted))
    step_ends = sorted({c[2] for c in chain})  # frameworks a step's last output can be in
    roots = []
    for _ in range(n_roots):
        tag = rng.choice(accepted + ["mixed"])  # a single-framework root must output an accepted one
        if tag == "mixed":
            # mostly able to take a step's last output: h = f(h)
            in_fw = rng.choice(step_ends) if rng.random() < 0.8 else rng.choice(FRAMEWORKS)
            roots.append([tag, in_fw, rng.choice(accepted)])
        else:
            roots.append([tag, tag, tag])
    names = [f"r{i}" for i in range(n_roots)] + [f"f{i}" for i in range(n - n_roots)]
    kinds = [(True, r) for r in roots] + [(False, c) for c in chain]
    chain_names = names[n_roots:]
    specs = []
    for name, (is_root, (tag, in_fw, out_fw)) in zip(names, kinds, strict=True):
        n_args = rng.choice((1, 1, 2))
        n_switch = 0 if tag != "mixed" else (1 if in_fw != out_fw else 2)
        n_ops = rng.randint(max(2, n_switch + 1), 5)
        ops = []
        for k in range(n_ops):
            op = rng.choice(SQUASH_OPS if k == n_ops - 1 else BODY_OPS)
            const = rng.choice(CONSTS) if op in ("mul", "addc", "where_gt") else 0.0
            use_arg = op in BINARY_OPS and n_args == 2 and rng.random() < 0.7
            ops.append(Op(op, const, use_arg))
        switches = tuple(sorted(rng.sample(range(1, n_ops), n_switch)))
        mutates = (not is_root) and rng.random() < 0.3
        cands = [c for c, (_, (_, cin, _)) in zip(chain_names, kinds[n_roots:], strict=True) if cin == out_fw]
        if len(cands) >= 2 and rng.random() < 0.7:
            succ = tuple(rng.sample(cands, 2))
        else:
            succ = (rng.choice(cands),) * 2 if cands else ("", "")
        specs.append(FnSpec(
            name=name, tag=tag, in_fw=in_fw, out_fw=out_fw, n_args=n_args, in_shape=shape, out_shape=shape,
            ops=tuple(ops), switches=switches, mutates=mutates, mutate_const=rng.choice(CONSTS),
            mutate_arg=mutates and n_args == 2 and rng.random() < 0.5, is_root=is_root, succ=succ))
    return Program(
        seed=seed, shape=shape, functions=tuple(specs), roots=tuple(names[:n_roots]),
        p_mark=rng.choice((0.1, 0.2, 0.3)), p_recurrent=rng.choice((0.3, 0.5, 0.7)),
        p_keep=rng.choice((0.05, 0.1, 0.15)), p_flip=0.5,
        lengths=rng.choice(((2, 3, 4), (2, 3, 3, 4), (2, 4), (3, 4))))


def problems(prog: Program) -> list[str]:
    """What makes ``prog`` invalid (empty when it is valid)."""
    out = []
    names = [f.name for f in prog.functions]
    if not 3 <= len(prog.functions) <= 6:
        out.append(f"{len(prog.functions)} functions")
    if len(set(names)) != len(names):
        out.append("duplicate names")
    if not prog.roots or any(not prog.fn(r).is_root for r in prog.roots):
        out.append("roots")
    chain = {f.name: f for f in prog.functions if not f.is_root}
    if not chain:
        out.append("no chain functions")
    for f in prog.functions:
        where = f"{f.name}: "
        if f.tag not in TAGS or f.in_fw not in FRAMEWORKS or f.out_fw not in FRAMEWORKS:
            out.append(where + "framework")
        if f.tag != "mixed" and not (f.in_fw == f.out_fw == f.tag):
            out.append(where + "single-framework function changes framework")
        if f.tag == "mixed" and not f.switches:
            out.append(where + "mixed function never converts")
        if f.switches and (f.switches[0] < 1 or f.switches[-1] > len(f.ops) - 1):
            out.append(where + "a conversion is not in the middle (ops before and after)")
        if (len(f.switches) % 2 == 1) != (f.in_fw != f.out_fw):
            out.append(where + "conversions do not lead to out_fw")
        if not 2 <= len(f.ops) <= 5 or f.ops[-1].name not in SQUASH_OPS:
            out.append(where + "ops")
        if f.n_args not in (1, 2) or any(o.use_arg for o in f.ops) and f.n_args != 2:
            out.append(where + "arguments")
        if f.mutates and f.is_root:
            out.append(where + "a root function mutates its (eager) input")
        if f.in_shape != prog.shape or f.out_shape != prog.shape:
            out.append(where + "shape")
        for s in f.succ:
            g = chain.get(s)
            if g is None:
                out.append(where + f"successor {s!r} is not a chain function")
            elif g.in_fw != f.out_fw or g.in_shape != f.out_shape:
                out.append(where + f"successor {s} does not take its output")
    if not out:
        reach, todo = set(), list(prog.roots)
        while todo:
            n = todo.pop()
            for s in prog.fn(n).succ:
                if s not in reach:
                    reach.add(s)
                    todo.append(s)
        if set(chain) - reach:
            out.append(f"unreachable: {sorted(set(chain) - reach)}")
        if not any(f.succ[0] != f.succ[1] for f in prog.functions):
            out.append("no branch")
        if not any(f.in_fw != f.out_fw for f in prog.functions):
            out.append("no function takes one framework and returns the other")
        nodes = node_probabilities(prog)
        if len(nodes) > MAX_NODES:
            out.append(f"{len(nodes)} tree nodes (at most {MAX_NODES})")
        if min(nodes.values()) < MIN_NODE_P:
            out.append(f"a tree node is reached in only {min(nodes.values()):.3f} of the steps")
    return out


MAX_NODES = 16  # tree nodes (distinct path prefixes) of a program
MIN_NODE_P = 1 / 20  # every node is reached in at least this share of the steps (when p_flip=0.5)


def node_probabilities(prog: Program) -> dict:
    """Each tree node (a path prefix, as a tuple of names) and the probability that a step
    reaches it, for fair branches (p_flip = 0.5)."""
    out: dict = {}

    def walk(path, f, p, left):
        out[path] = out.get(path, 0.0) + p
        if left == 0:
            return
        for s in f.succ:
            walk(path + (s,), prog.fn(s), p / 2, left - 1)

    for r in prog.roots:
        for length in prog.lengths:
            walk((r,), prog.fn(r), 1 / len(prog.roots) / len(prog.lengths), length - 1)
    return out


# ---------------------------------------------------------------------- framework operations


class _ArrayOps:
    """Operations shared by CuPy and numpy (``xp`` is the module)."""

    def __init__(self, xp):
        self.xp = xp

    def mul(self, x, c):
        return x * c

    def addc(self, x, c):
        return x + c

    def add(self, x, y):
        return x + y

    def mul_arg(self, x, y):
        return x * y

    def abs(self, x):
        return self.xp.abs(x)

    def sin(self, x):
        return self.xp.sin(x)

    def tanh(self, x):
        return self.xp.tanh(x)

    def exp_clamp(self, x, lo, hi):
        return self.xp.exp(self.xp.clip(x, lo, hi))

    def where_gt(self, x, c, y):
        return self.xp.where(x > c, x, y)

    def iadd(self, x, y):
        x += y

    def from_dlpack(self, x):
        return self.xp.from_dlpack(x)


class CupyOps(_ArrayOps):
    def fresh(self, host):
        return self.xp.asarray(host)

    def to_host(self, x):
        return self.xp.asnumpy(x)


class NumpyOps(_ArrayOps):
    """numpy standing in for a framework on the CPU (eager runs only)."""

    def __init__(self, xp=np):
        super().__init__(xp)

    def fresh(self, host):
        return np.array(host, copy=True)

    def to_host(self, x):
        return np.array(x, copy=True)


class TorchOps(_ArrayOps):
    """The same operations on torch tensors (torch has ``abs``, ``clip``, ``where``, ``from_dlpack``
    and in-place ``+=`` under the same names)."""

    def __init__(self, torch, device: str = "cuda"):
        super().__init__(torch)
        self.torch = torch
        self.device = device

    def fresh(self, host):
        return self.torch.from_numpy(host).to(self.device)

    def to_host(self, x):
        return x.cpu().numpy()  # outputs never require grad; a poisoned output raises here


@dataclass
class Namespace:
    """What ``run`` works with: the operations of each framework.

    ``overwritten_pattern``: text of the error that reading a poisoned output raises.
    ``cupy_outputs_poisoned``: True where CuPy outputs are poisoned like torch's (a fake that
    cannot tell them apart); the walk then never passes a CuPy output across an explicit mark.
    ``owned_by_tree``: in graphed runs, whether an output lives in the tree's memory (only such
    outputs are poisoned when their generation ends; a warm-up's output is the caller's memory).
    """

    torch: object
    cupy: object
    overwritten_pattern: str = OVERWRITTEN
    cupy_outputs_poisoned: bool = False
    owned_by_tree: object = None

    def ops(self, fw: str):
        return self.torch if fw == "torch" else self.cupy


def real_namespace(torch, cupy, device: str = "cuda") -> Namespace:
    return Namespace(TorchOps(torch, device), CupyOps(cupy))


def numpy_namespace() -> Namespace:
    return Namespace(NumpyOps(), NumpyOps())


def make_function(spec: FnSpec, ns: Namespace):
    """The plain Python function of ``spec`` over ``ns``; named after the spec."""
    ops_of = ns.ops

    def body(*args):
        a = args[0]
        b = args[1] if spec.n_args == 2 else None
        fw = spec.in_fw
        ops = ops_of(fw)
        if spec.mutates:
            ops.iadd(a, b if spec.mutate_arg else spec.mutate_const)
        v = a
        for k, op in enumerate(spec.ops):
            if k in spec.switches:  # zero-copy to the other framework, mid-body
                fw = _other(fw)
                ops = ops_of(fw)
                v = ops.from_dlpack(v)
                if b is not None:
                    b = ops.from_dlpack(b)
            v = _apply(ops, op, v, b)
        return v

    body.__name__ = body.__qualname__ = spec.name
    return body


def _apply(ops, op: Op, v, b):
    name = op.name
    if name == "mul":
        return ops.mul(v, op.const)
    if name == "addc":
        return ops.addc(v, op.const)
    if name == "add":
        return ops.add(v, b if op.use_arg else v)
    if name == "mul_arg":
        return ops.mul_arg(v, b if op.use_arg else v)
    if name == "where_gt":
        return ops.where_gt(v, op.const, b if op.use_arg else ops.mul(v, -0.5))
    if name == "exp_clamp":
        return ops.exp_clamp(v, *CLAMP)
    return getattr(ops, name)(v)  # abs, sin, tanh


# ---------------------------------------------------------------------- the interpreter


class Entry(NamedTuple):
    """One log line: ``call`` is the index of the call that produced the output, ``value`` its
    host copy (or RAISED / NOT_READ); ``what`` is "out" (read right after the call) or "kept"
    (read again later, after call ``at``); ``expect_raise``: a torch output read after a
    generation boundary, which a graphed run must refuse."""

    call: int
    name: str
    value: object
    what: str = "out"
    expect_raise: bool = False
    at: int = -1


@dataclass
class RunResult:
    graphed: bool = False
    log: list = field(default_factory=list)
    calls: int = 0
    steps: int = 0
    marks: int = 0  # explicit mark_step_begin() calls
    recurrent: Counter = field(default_factory=Counter)  # root calls on the previous step's last
    # output (h = f(h)), by (framework, "mark" or "inferred": how the generation began)
    kept_reads: int = 0  # kept outputs read again (same step or later)
    expected_raises: int = 0  # of those, torch outputs read after a generation boundary (graphed
    # runs: those in the tree's memory)
    raised: int = 0  # reads that raised "overwritten" (graphed runs)
    kept_valid: int = 0  # graphed runs: torch outputs read after a boundary that the tree does not
    # own (warm-up outputs): they must still hold the eager value
    not_read: int = 0  # CuPy outputs kept across a generation, not read
    fn_calls: Counter = field(default_factory=Counter)
    paths: Counter = field(default_factory=Counter)  # tuple of function names per step
    bits: Counter = field(default_factory=Counter)  # branch outcomes
    settled_at: int = 0  # calls made when a path prefix was reached a second time, last: where the
    # tree records its last node (a node is recorded on its second call) if nothing is skipped
    probes: dict = field(default_factory=dict)  # call count -> probe()

    def summary(self) -> str:
        return (f"{self.calls} calls, {self.steps} steps, {len(self.paths)} distinct paths, {self.marks} marks, "
                f"{sum(self.recurrent.values())} h=f(h), {self.kept_reads} kept reads "
                f"({self.expected_raises} expected to raise, {self.raised} raised), "
                f"{self.not_read} CuPy outputs kept across generations")


@dataclass
class _Kept:
    obj: object
    fw: str
    name: str
    call: int
    step: int
    due: int
    owned: bool = True  # in the tree's memory (graphed runs; decided right after the call)


def run(program: Program, ns: Namespace, n_calls: int, *, graphed: bool, mark_step_begin=None,
        graphed_decorator=None, probe=None, probe_at=()) -> RunResult:
    """Walk ``program`` for at least ``n_calls`` calls (the last step is finished).

    graphed: wrap each function with ``graphed_decorator`` and call ``mark_step_begin`` where a
    step is marked; otherwise call the plain functions (the marks are counted, not called).
    probe: called after the call that brings the count to each of ``probe_at``; its results are
    in ``RunResult.probes``. The walk's decisions depend only on the seed and on the host copies
    of outputs, so a graphed and an eager run take the same path as long as their outputs agree.
    """
    if graphed and (mark_step_begin is None or graphed_decorator is None):
        raise ValueError("a graphed run needs mark_step_begin and graphed_decorator")
    specs = {f.name: f for f in program.functions}
    plain = {f.name: make_function(f, ns) for f in program.functions}
    fns = {k: graphed_decorator(v) for k, v in plain.items()} if graphed else plain
    rng = random.Random(program.seed * 1_000_003 + 17)
    data = np.random.default_rng([program.seed, 6])
    probe_at = frozenset(probe_at)
    res = RunResult(graphed=graphed)
    used_roots: set = set()
    prev_last = None  # (last output of the previous step, its framework)
    pending: list[_Kept] = []
    visits: Counter = Counter()  # path prefix (tree node) -> steps that reached it
    shape = program.shape

    def fresh(fw):
        host = (data.uniform(0.5, 2.0, shape) * data.choice((-1.0, 1.0), shape)).astype(DTYPE)  # never 0
        return ns.ops(fw).fresh(host)

    def call(spec: FnSpec, args, step: int, path: list):
        i = res.calls
        try:
            out = fns[spec.name](*args)
            host = ns.ops(spec.out_fw).to_host(out)  # right after the call, before anything else runs
        except Exception as exc:
            if hasattr(exc, "add_note"):
                exc.add_note(f"in call {i} ({spec.name}) of step {step}, after {path} "
                             f"({'graphed' if graphed else 'eager'} walk of program seed {program.seed})")
            raise
        res.log.append(Entry(i, spec.name, host))
        res.calls += 1
        res.fn_calls[spec.name] += 1
        path.append(spec.name)
        visits[tuple(path)] += 1
        if visits[tuple(path)] == 2:
            res.settled_at = res.calls
        if probe is not None and res.calls in probe_at:
            res.probes[res.calls] = probe()
        if rng.random() < program.p_keep and len(pending) < 4:
            owned = not graphed or ns.owned_by_tree is None or bool(ns.owned_by_tree(out))
            pending.append(_Kept(out, spec.out_fw, spec.name, i, step, step + rng.choice((0, 0, 1, 1, 2, 3)),
                                 owned))
        return out, host

    step = 0
    while res.calls < n_calls:
        root = specs[rng.choice(program.roots)]
        # a root's first root call must follow a mark: before it, the tree does not know it as a root
        mark = step == 0 or root.name not in used_roots or rng.random() < program.p_mark
        used_roots.add(root.name)
        recurrent = False
        if prev_last is not None and prev_last[1] == root.in_fw and rng.random() < program.p_recurrent:
            poisoned = prev_last[1] == "torch" or ns.cupy_outputs_poisoned
            recurrent = not (mark and poisoned)  # after an explicit mark a torch output is dead
        length = rng.choice(program.lengths)
        if mark:
            res.marks += 1
            if graphed:
                mark_step_begin()
        x = prev_last[0] if recurrent else fresh(root.in_fw)
        if recurrent:
            res.recurrent[root.in_fw, "mark" if mark else "inferred"] += 1
        prev_last = None
        args = (x, fresh(root.in_fw)) if root.n_args == 2 else (x,)
        del x
        path: list = []
        out, host = call(root, args, step, path)
        f = root
        for _ in range(length - 1):
            bit = _branch(host, res.calls, rng, program.p_flip)
            res.bits[bit] += 1
            nxt = specs[f.succ[bit]]
            args = (out, fresh(nxt.in_fw)) if nxt.n_args == 2 else (out,)
            out, host = call(nxt, args, step, path)
            f = nxt
        del args
        res.paths[tuple(path)] += 1
        prev_last = (out, f.out_fw)
        del out
        _read_due(res, pending, step, ns, graphed)
        step += 1
    res.steps = step
    pending.clear()  # no device object outlives the run
    prev_last = None
    return res


def _branch(host: np.ndarray, counter: int, rng: random.Random, p_flip: float) -> int:
    """The host-side branch: two elements of the host copy, chosen by the call counter, compared,
    then flipped by the seeded RNG with probability ``p_flip`` (0.5: a fair coin, so each branch
    is taken half the time whatever the data, yet the data still decides between the two)."""
    flat = host.reshape(-1)
    j = counter % flat.size
    bit = bool(flat[j] > flat[(7 * j + 3) % flat.size])
    if rng.random() < p_flip:
        bit = not bit
    return int(bit)


def _read_due(res: RunResult, pending: list, step: int, ns: Namespace, graphed: bool) -> None:
    """At the end of a step, read the kept outputs that are due: those of this step must hold
    their values; torch outputs of earlier steps (generations) must raise; CuPy ones are skipped."""
    due = [k for k in pending if k.due <= step]
    pending[:] = [k for k in pending if k.due > step]
    at = res.calls - 1
    for k in due:
        same_generation = k.step == step
        if not same_generation and k.fw == "cupy":
            res.not_read += 1
            res.log.append(Entry(k.call, k.name, NOT_READ, "kept", False, at))
            continue
        expect_raise = not same_generation and k.owned  # a torch output of an ended generation
        res.kept_reads += 1
        res.expected_raises += expect_raise
        res.kept_valid += not same_generation and not k.owned
        try:
            value = ns.ops(k.fw).to_host(k.obj)
        except RuntimeError as exc:
            if not (graphed and expect_raise and ns.overwritten_pattern in str(exc)):
                raise AssertionError(
                    f"reading the output of call {k.call} ({k.name}, step {k.step}) at the end of step {step} "
                    f"raised unexpectedly (expected a raise: {expect_raise}): {exc}") from exc
            value = RAISED
            res.raised += 1
        res.log.append(Entry(k.call, k.name, value, "kept", expect_raise, at))


# ---------------------------------------------------------------------- comparison


def bitwise_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(np.array_equal(np.ascontiguousarray(a).reshape(-1).view(np.uint8),
                               np.ascontiguousarray(b).reshape(-1).view(np.uint8)))


def compare(graphed: RunResult, eager: RunResult, limit: int = 5) -> list[str]:
    """Differences between a graphed and an eager run of one program (empty: they agree).

    Outputs must be bitwise equal; a read the harness expects to raise must have raised in the
    graphed run (the eager value is not compared there), and a kept output the tree does not own
    must equal the eager value; the logs must line up entry by entry. Two eager runs
    (``graphed.graphed`` False) are compared everywhere."""
    out = []
    if len(graphed.log) != len(eager.log):
        out.append(f"logs differ in length: graphed {len(graphed.log)}, eager {len(eager.log)}")
    for g, e in zip(graphed.log, eager.log, strict=False):  # a length difference is reported above
        if (g.call, g.name, g.what, g.at) != (e.call, e.name, e.what, e.at) or (g.expect_raise and not e.expect_raise):
            out.append(f"the runs diverged: graphed {g[:2] + g[3:]}, eager {e[:2] + e[3:]}")
            break
        where = f"call {g.call} ({g.name}, {g.what}{'' if g.at < 0 else f' read after call {g.at}'})"
        if g.expect_raise and graphed.graphed:
            if not (isinstance(g.value, str) and g.value == RAISED):
                out.append(f"{where}: a torch output of an ended generation was read without error")
        elif isinstance(g.value, str) or isinstance(e.value, str):
            if not (isinstance(g.value, str) and isinstance(e.value, str) and g.value == e.value):
                out.append(f"{where}: graphed {g.value!r}, eager {e.value!r}")
        elif not bitwise_equal(g.value, e.value):
            gv, ev = np.asarray(g.value), np.asarray(e.value)
            detail = ""
            if gv.shape == ev.shape and gv.dtype == ev.dtype:
                diff = np.flatnonzero(gv.reshape(-1) != ev.reshape(-1))
                detail = (f"; {diff.size} of {gv.size} elements differ, first at {diff[:3].tolist()}" if diff.size
                          else "; equal values, different bits (signed zeros or NaN payloads)")
            out.append(f"{where}: graphed output differs from eager{detail} "
                       f"(graphed {gv.reshape(-1)[:4]}, eager {ev.reshape(-1)[:4]})")
        if len(out) >= limit:
            break
    return out
