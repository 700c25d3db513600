"""Random torch programs of a few ops, for a differential test of graphed functions against eager.

A program takes one to three float tensors, applies two to seven ops drawn from ``UNARY`` and
``BINARY`` (views, in-place writes into the inputs or into views of them, reductions, indexing,
dtype round trips, copies), and returns one to three of the values it made, as a tensor, a tuple,
a list or a dict. Its inputs come in the layouts users pass: contiguous, transposed, strided with
gaps (``x[::2]``), at a storage offset, expanded (stride 0) and a channels-last-like permutation.
``generate(seed)`` is deterministic; ``inputs(program, seed)`` makes a call's tensors (fresh
values, the program's layouts) and ``twins(xs)`` copies of them with the same layouts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


def _unary_ops():
    def rows(x):
        return x.shape[0]

    def square_2d(x):
        return x.dim() == 2

    def write_first_row(x):
        x[0].fill_(1.5)
        return x

    def halve_first_row(x):
        x[:1].mul_(0.5)
        return x

    def zero_first_column(x):
        x[..., :1].zero_()
        return x

    return {
        "sin": torch.sin, "tanh": torch.tanh, "abs": torch.abs, "neg": torch.neg, "relu": torch.relu,
        "exp_small": lambda x: (x * 0.1).exp(),
        "cumsum": lambda x: x.cumsum(0),
        "softmax": lambda x: x.softmax(-1),
        "t": lambda x: x.t() if square_2d(x) else x,
        "transpose": lambda x: x.transpose(0, 1) if x.dim() >= 2 else x,
        "rows_from_1": lambda x: x[1:] if rows(x) > 2 else x,
        "unsqueeze_squeeze": lambda x: x.unsqueeze(0).squeeze(0),
        "flip": lambda x: x.flip(0),
        "contiguous": lambda x: x.contiguous(),
        "clone": lambda x: x.clone(),
        "mul_": lambda x: x.mul_(2.0),
        "add_": lambda x: x.add_(1.0),
        "clamp_": lambda x: x.clamp_(-3.0, 3.0),
        "sum_expanded": lambda x: x.sum(0, keepdim=True).expand_as(x),
        "mean_plus": lambda x: x.mean(-1, keepdim=True) + x,
        "expand_first_row": lambda x: x[:1].expand_as(x),
        "reshape_round_trip": lambda x: x.reshape(-1).reshape(x.shape),
        "narrow": lambda x: x.narrow(0, 0, max(1, rows(x) - 1)),
        "tril": lambda x: x.tril() if square_2d(x) else x,
        "roll": lambda x: x.roll(1, 0),
        "sort": lambda x: x.sort(-1).values,
        "topk_plus": lambda x: x.topk(1, -1).values.expand_as(x) + x,
        "cat_cut": lambda x: torch.cat([x, x], 0)[: rows(x)],
        "stack_sum": lambda x: torch.stack([x, -x]).sum(0),
        "where": lambda x: torch.where(x > 0, x, x * 0.5),
        "index_select": lambda x: x.index_select(0, torch.arange(rows(x) - 1, -1, -1)),
        "gather_first": lambda x: x.gather(0, torch.zeros_like(x, dtype=torch.long)),
        "masked_fill": lambda x: x.masked_fill(x < 0, 0.25),
        "double_round_trip": lambda x: (x.double() * 1.5).float(),
        "maximum_flipped": lambda x: torch.maximum(x, x.flip(0)),
        "std_plus": lambda x: x.std(0, keepdim=True) + x,
        "normalise": lambda x: x / (x.norm(dim=-1, keepdim=True) + 1),
        "detach": lambda x: x.detach(),
        "view_as": lambda x: x.view_as(x),
        "chunk": lambda x: x.chunk(2, 0)[0],
        "split_last": lambda x: x.split(2, -1)[-1],
        "unbind_sum": lambda x: sum(x.unbind(0)),
        "index_put_": lambda x: x.index_put_((torch.tensor([0]),), torch.tensor(3.0)),
        "scatter_add_": lambda x: x.scatter_add_(0, torch.zeros_like(x, dtype=torch.long), x.clone()),
        "halve_first_row": halve_first_row,
        "write_first_row": write_first_row,
        "zero_first_column": zero_first_column,
        "diagonal": lambda x: x.diagonal() if square_2d(x) else x,
        "mask_product": lambda x: x * (x > 0),
        "long_round_trip": lambda x: (x * 10).long().float() / 10,
        "first_row": lambda x: x[0],
        "movedim": lambda x: x.movedim(0, -1) if x.dim() >= 2 else x,
        "unfold_sum": lambda x: x.unfold(0, 2, 1).sum(-1) if rows(x) >= 2 else x,
        "identity": lambda x: x,
        "argmax_gather": lambda x: x.gather(-1, x.argmax(-1, keepdim=True)) + x,
        "cummax": lambda x: x.cummax(0).values,
        "below_tenth": lambda x: (x < 0.1).float(),
    }


def _binary_ops():
    def fit(a, b):
        """``b`` as ``a``'s shape: its first elements, or its sum broadcast."""
        if a.shape == b.shape:
            return b
        return b.reshape(-1)[: a.numel()].reshape(a.shape) if b.numel() >= a.numel() else b.sum() + a * 0

    return {
        "add": lambda a, b: a + fit(a, b),
        "mul": lambda a, b: a * fit(a, b),
        "div": lambda a, b: a / (fit(a, b).abs() + 1),
        "maximum": lambda a, b: torch.maximum(a, fit(a, b)),
        "addcmul": lambda a, b: torch.addcmul(a, a, fit(a, b), value=0.5),
        "lerp": lambda a, b: torch.lerp(a, fit(a, b), 0.3),
        "matmul": lambda a, b: a @ fit(a, b).t() if a.dim() == 2 else a * fit(a, b),
        "atan2": lambda a, b: torch.atan2(a, fit(a, b)),
        "copy_": lambda a, b: a.copy_(fit(a, b)),
        "add_into_": lambda a, b: a.add_(fit(a, b)),
    }


UNARY = _unary_ops()
BINARY = _binary_ops()
LAYOUTS = ("contiguous", "contiguous", "transposed", "gaps", "offset", "expanded", "permuted")
RESULTS = ("single", "tuple", "list", "dict")


@dataclass(frozen=True)
class Program:
    """``steps``: ``("u", op, i)`` or ``("b", op, i, j)`` over the values so far (the inputs first);
    ``outs``: the indices of the values returned, as ``result``."""

    seed: int
    layouts: tuple
    steps: tuple
    outs: tuple
    result: str

    def __call__(self, *xs):
        vals = list(xs)
        for step in self.steps:
            if step[0] == "u":
                vals.append(UNARY[step[1]](vals[step[2]]))
            else:
                vals.append(BINARY[step[1]](vals[step[2]], vals[step[3]]))
        out = [vals[i] for i in self.outs]
        if self.result == "single":
            return out[0]
        if self.result == "dict":
            return {f"out{i}": t for i, t in enumerate(out)}
        return out if self.result == "list" else tuple(out)

    def describe(self) -> str:
        return f"seed {self.seed}: inputs {self.layouts}, steps {self.steps}, returns {self.outs} as {self.result}"


def generate(seed: int) -> Program:
    rng = random.Random(seed)
    n_in = rng.randint(1, 3)
    layouts = tuple(rng.choice(LAYOUTS) for _ in range(n_in))
    steps, n = [], n_in
    for _ in range(rng.randint(2, 7)):
        if n >= 2 and rng.random() < 0.35:
            steps.append(("b", rng.choice(sorted(BINARY)), rng.randrange(n), rng.randrange(n)))
        else:
            steps.append(("u", rng.choice(sorted(UNARY)), rng.randrange(n)))
        n += 1
    outs = tuple(rng.randrange(n) for _ in range(rng.randint(1, 3)))
    return Program(seed, layouts, tuple(steps), outs, rng.choice(RESULTS))


def inputs(program: Program, seed: int) -> list:
    """Fresh (5, 4) float tensors in the program's layouts."""
    g = torch.Generator().manual_seed(seed)
    make = {
        "contiguous": lambda: torch.randn(5, 4, generator=g),
        "transposed": lambda: torch.randn(4, 5, generator=g).t(),
        "gaps": lambda: torch.randn(10, 4, generator=g)[::2],
        "offset": lambda: torch.randn(6, 4, generator=g)[1:],
        "expanded": lambda: torch.randn(1, 4, generator=g).expand(5, 4),
        "permuted": lambda: torch.randn(5, 4, 1, generator=g).permute(0, 2, 1)[:, 0, :],
    }
    return [make[layout]() for layout in program.layouts]


def twins(xs) -> list:
    """Copies of ``xs`` with the same sizes, strides and storage offsets (over copies of their bases)."""
    out = []
    for x in xs:
        base = x._base if x._base is not None else x
        out.append(base.clone().as_strided(x.shape, x.stride(), x.storage_offset()))
    return out


def leaves(out) -> list:
    """The tensors of a result, in order."""
    if isinstance(out, dict):
        out = list(out.values())
    return list(out) if isinstance(out, (list, tuple)) else [out]
