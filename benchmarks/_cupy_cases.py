"""The cases of ``benchmarks.cupy_coverage``: CuPy and cupyx.scipy functions with small random inputs.

Pure data, importable without CuPy (the CPU tests count and check it): a case names the function
by its dotted path (resolved at run time), makes its inputs on the host with NumPy, and calls the
function through ``call(f, *args)`` with ``f`` the resolved function. ``setup(ns, *arrays)`` builds
objects from the device inputs before the capture (sparse matrices, generators); ``ns`` has
``cp`` (cupy) and ``sparse`` (cupyx.scipy.sparse). ``expect`` says why a case is expected to fail
the capture today (None: expected to record and replay equal); the run reports where it was wrong.
The cuBLAS expectations follow ``cgraw.interop.cupy.blas`` (CuPy's matrix products routed to a
cgraw handle). The cuSOLVER ones follow ``cgraw.interop.cupy.solver`` (CuPy's dense cuSOLVER calls
routed to a cgraw handle), the single-matrix svd/eigh family included (gesvd and Xsyevd run as the
batched Jacobi routines). The cuSPARSE ones follow ``cgraw.interop.cupy.sparse`` (sparse @ dense
products routed, csrgeam2 refused by name). Notes marked "H200" say what a run there showed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

COMPARES = ("allclose", "exact", "random", "svd", "eigh", "algorithm")
# the module a row is counted under: the longest of these that prefixes its function
MODULES = ("cupyx.scipy.ndimage", "cupyx.scipy.signal", "cupyx.scipy.special", "cupyx.scipy.sparse",
           "cupy.linalg", "cupy.fft", "cupy.random", "cupy")
# why a case is expected to fail the capture today: the kinds of CaptureError (cupy_coverage.error_kind)
CUBLAS, CUSOLVER, CUSPARSE, UPLOAD, SYNC, RNG = "cuBLAS", "cuSOLVER", "cuSPARSE", "upload", "host sync", "rng"
EXPECT_TEXT = {
    CUBLAS: "a cuBLAS call cgraw does not route (CuPy refuses it during stream capture)",
    CUSOLVER: "CuPy refuses cuSOLVER calls during stream capture",
    CUSPARSE: "a cuSPARSE call cgraw refuses by name or does not route (CuPy refuses it during stream capture)",
    UPLOAD: "the call uploads host data other than through cupy.asarray/array (ndarray.set), which CuPy refuses",
    SYNC: "the call reads a device value on the host (data-dependent shape or count)",
    RNG: "a cupy.random function cgraw does not draw itself",
}

@dataclasses.dataclass(frozen=True)
class Arr:
    """A host array of a fixed shape and dtype with fresh random values at every ``make``.

    Floats: uniform in [lo, hi) when both are given, else standard normal; ``nan`` is the fraction
    of elements made NaN. Integers: uniform in [lo, hi) (default [-50, 50)). bool: fair coin.
    Complex: standard normal real and imaginary parts.
    """

    shape: tuple
    dtype: str = "float32"
    lo: float | None = None
    hi: float | None = None
    nan: float = 0.0

    def make(self, rng: np.random.Generator) -> np.ndarray:
        dt = np.dtype(self.dtype)
        if dt == np.bool_:
            return rng.random(self.shape) < 0.5
        if dt.kind in "iu":
            lo = -50 if self.lo is None else int(self.lo)
            hi = 50 if self.hi is None else int(self.hi)
            return rng.integers(lo, hi, size=self.shape).astype(dt)
        if dt.kind == "c":
            return (rng.standard_normal(self.shape) + 1j * rng.standard_normal(self.shape)).astype(dt)
        if self.lo is not None and self.hi is not None:
            x = rng.uniform(self.lo, self.hi, self.shape)
        else:
            x = rng.standard_normal(self.shape)
        x = np.asarray(x, dtype=dt)
        if self.nan:
            x[rng.random(self.shape) < self.nan] = np.nan
        return x


@dataclasses.dataclass(frozen=True)
class Maker:
    """A host array from ``fn(rng)``: for inputs with structure (sorted, SPD, probabilities)."""

    fn: Callable[[np.random.Generator], np.ndarray]
    label: str

    def make(self, rng: np.random.Generator) -> np.ndarray:
        return np.ascontiguousarray(self.fn(rng))


@dataclasses.dataclass(frozen=True)
class Law:
    """What a random case's output must look like (cgraw's numbers are not eager's).

    Every value in [lo, hi) ([lo, hi] with ``closed``); the sample mean within 6 standard errors
    of ``mean``; the sample standard deviation within 15% of ``std``; ``integer``: whole numbers;
    ``support``: every value is one of input ``support``'s values; ``minus``: input ``minus`` is
    subtracted before the checks (array parameters such as ``normal(loc=x)``); ``distinct``: no
    value twice (a permutation).
    """

    lo: float | None = None
    hi: float | None = None
    closed: bool = False
    mean: float | None = None
    std: float | None = None
    integer: bool = False
    support: int | None = None
    minus: int | None = None
    distinct: bool = False


@dataclasses.dataclass(frozen=True)
class Case:
    """One row of the coverage table.

    ``name`` is unique; the function is the part before `` [`` (a variant's label), or
    ``target`` when given. ``inputs`` make the host arrays; their device copies, made before the
    capture and refreshed in place before each replay, are the arguments of ``call(f, *args)``
    (after ``setup`` when given). ``compare``: ``allclose`` (exact for integer and bool outputs),
    ``exact``, ``random`` (with ``law``), or ``svd``/``eigh`` (vectors unique only up to sign/phase: values
    against eager's, the factorisation against the input; ``cupy_coverage.compare_factors``), or
    ``algorithm`` (the capture runs another algorithm than eager, outputs unique: allclose at the
    factorisation checks' tolerance).
    """

    name: str
    section: str
    inputs: tuple = ()
    call: Callable[..., Any] | None = None
    setup: Callable[..., tuple] | None = None
    compare: str = "allclose"
    law: Law | None = None
    target: str | None = None
    expect: str | None = None
    note: str = ""

    @property
    def function(self) -> str:
        return self.target or self.name.split(" [", 1)[0]

    @property
    def module(self) -> str:
        f = self.function
        return next(m for m in MODULES if f == m or f.startswith(m + "."))

    def host_inputs(self, rng: np.random.Generator) -> list:
        return [spec.make(rng) for spec in self.inputs]

    def invoke(self, f, args):
        return f(*args) if self.call is None else self.call(f, *args)


# ---------------------------------------------------------------- inputs

N = 256
V = Arr((N,))
V64 = Arr((N,), "float64")
W = Arr((N,))
POS = Arr((N,), lo=0.5, hi=4.0)
POS64 = Arr((N,), "float64", lo=0.5, hi=4.0)
UNIT = Arr((N,), lo=-0.9, hi=0.9)
PROB = Arr((N,), lo=0.05, hi=0.95)
NANS = Arr((32, 32), nan=0.1)
B = Arr((N,), "bool")
I32 = Arr((N,), "int32")
C64 = Arr((N,), "complex64")
M = Arr((32, 32))
MB = Arr((32, 32), "bool")
SQ = Arr((16, 16))
SQ64 = Arr((16, 16), "float64")
T3 = Arr((4, 8, 16))
IMG = Arr((32, 32))
CIMG = Arr((32, 32), "complex64")
W3 = Arr((3, 3))
TAPS = Arr((5,))
RSIZE = 4096  # samples per random case


def _sorted(n: int, dtype: str = "float32") -> Maker:
    return Maker(lambda rng: np.sort(rng.standard_normal(n)).astype(dtype), f"sorted({n})")


def _well_conditioned(n: int, dtype: str = "float32") -> Maker:
    return Maker(lambda rng: (rng.standard_normal((n, n)) + n * np.eye(n)).astype(dtype), f"A+{n}I({n}x{n})")


def _gemv(f, a, x):
    """``cupy.cublas.gemv`` writes ``y = alpha op(a) x + beta y`` in place and returns None."""
    y = x * 0  # a fresh array (beta = 0 does not read it)
    f("N", 0.5, a, x, 0.0, y)
    return y


def _batched_well_conditioned(b: int, n: int) -> Maker:
    return Maker(lambda rng: (rng.standard_normal((b, n, n)) + n * np.eye(n)).astype(np.float32),
                 f"{b} x A+{n}I({n}x{n})")


def _spd(n: int, dtype: str = "float32") -> Maker:
    def make(rng):
        a = rng.standard_normal((n, n))
        return (a @ a.T + n * np.eye(n)).astype(dtype)

    return Maker(make, f"SPD({n})")


def _symmetric(n: int, batch: tuple = ()) -> Maker:
    def make(rng):
        a = rng.standard_normal((*batch, n, n))
        return ((a + a.swapaxes(-1, -2)) / 2).astype(np.float32)

    return Maker(make, f"{' x '.join(map(str, batch))}{' x ' if batch else ''}symmetric({n})")


def _probabilities(k: int) -> Maker:
    def make(rng):
        p = rng.uniform(0.1, 1.0, k)
        return p / p.sum()

    return Maker(make, f"probabilities({k})")


def _coin(shape: tuple, p: float) -> Maker:
    return Maker(lambda rng: rng.random(shape) < p, f"bool{list(shape)} p={p:g}")


def _coarse(n: int, levels: int = 4) -> Maker:
    """Whole numbers below ``levels`` as float32: two of these are equal in 1/levels of the places."""
    return Maker(lambda rng: rng.integers(0, levels, n).astype(np.float32), f"float32[{n}] in 0..{levels - 1}")


def _stable_denominator(rng) -> np.ndarray:
    return np.array([1.0, rng.uniform(-0.4, 0.4), rng.uniform(-0.2, 0.2)], np.float32)


DEN = Maker(_stable_denominator, "[1, a1, a2] (stable)")
SOS = Maker(lambda rng: np.stack([np.concatenate([rng.standard_normal(3), _stable_denominator(rng)])
                                  for _ in range(2)]).astype(np.float32), "sos(2 sections, stable)")

# a CSR matrix of fixed structure (same sparsity every round), fresh values
SPARSE_SHAPE = (32, 48)
_SP_MASK = np.random.default_rng(17).random(SPARSE_SHAPE) < 0.15
_SP_ROWS, _SP_COLS = np.nonzero(_SP_MASK)
SP_NNZ = int(_SP_MASK.sum())
SP_DATA = Arr((SP_NNZ,))
SP_INDICES = Maker(lambda rng: _SP_COLS.astype(np.int32), "csr indices (fixed)")
SP_INDPTR = Maker(lambda rng: np.concatenate([[0], np.cumsum(_SP_MASK.sum(axis=1))]).astype(np.int32),
                  "csr indptr (fixed)")
SP_INPUTS = (SP_DATA, SP_INDICES, SP_INDPTR)


def _csr(ns, data, indices, indptr):
    return ns.sparse.csr_matrix((data, indices, indptr), shape=SPARSE_SHAPE)


def _csr_setup(ns, data, indices, indptr, *rest):
    return (_csr(ns, data, indices, indptr), *rest)


# ---------------------------------------------------------------- cases


def _elementwise() -> list[Case]:
    s = "elementwise"
    unary = {V: ("sin", "cos", "tan", "tanh", "arcsinh", "exp", "expm1", "square", "absolute", "sign", "floor",
                 "sinc", "i0", "signbit"),
             POS: ("log", "log1p", "sqrt", "reciprocal"),
             UNIT: ("arcsin", "arccos")}
    cases = [Case(f"cupy.{f}", s, (spec,)) for spec, names in unary.items() for f in names]
    binary = {(V, W): ("add", "subtract", "multiply", "arctan2", "hypot", "copysign", "maximum", "logaddexp",
                       "greater"),
              (V, POS): ("divide", "floor_divide", "fmod", "remainder")}
    cases += [Case(f"cupy.{f}", s, specs) for specs, names in binary.items() for f in names]
    exps = Arr((N,), lo=-2.0, hi=2.0)
    ints, shifts = Arr((N,), "int32", 0, 1 << 20), Arr((N,), "int32", 0, 8)
    cases += [
        Case("cupy.isnan", s, (Arr((N,), nan=0.2),)),
        Case("cupy.isclose", s, (_coarse(N), _coarse(N))),
        Case("cupy.heaviside", s, (_coarse(N), V)),
        Case("cupy.power", s, (POS, exps)),
        Case("cupy.float_power", s, (POS, exps)),
        Case("cupy.ldexp", s, (V, Arr((N,), "int32", -4, 5))),
        Case("cupy.frexp", s, (V,)),
        Case("cupy.modf", s, (V,)),
        Case("cupy.around", s, (V,), lambda f, x: f(x, 2)),
        Case("cupy.clip", s, (V,), lambda f, x: f(x, -0.5, 0.5)),
        Case("cupy.where", s, (B, V, W)),
        Case("cupy.logical_and", s, (B, Arr((N,), "bool"))),
        Case("cupy.logical_not", s, (B,)),
        Case("cupy.bitwise_and", s, (ints, ints)),
        Case("cupy.invert", s, (ints,)),
        Case("cupy.left_shift", s, (ints, shifts)),
        Case("cupy.conj", s, (C64,)),
        Case("cupy.real", s, (C64,)),
        Case("cupy.angle", s, (C64,)),
        Case("cupy.absolute [complex64]", s, (C64,)),
        Case("cupy.exp [complex64]", s, (C64,)),
        Case("cupy.exp [float64]", s, (V64,)),
        Case("cupy.sqrt [float64]", s, (POS64,)),
        Case("cupy.add [int32]", s, (I32, I32)),
        Case("cupy.interp", s, (Arr((N,), lo=-2.0, hi=2.0), _sorted(64), Arr((64,)))),
        Case("cupy.convolve", s, (V, Arr((7,)))),
        Case("cupy.cross", s, (Arr((64, 3)), Arr((64, 3)))),
        Case("cupy.gradient", s, (V,)),
        Case("cupy.diff", s, (V,)),
        Case("cupy.trapezoid", s, (V,)),
        Case("cupy.select", s, (B, Arr((N,), "bool"), V, W), lambda f, c1, c2, x, y: f([c1, c2], [x, y], 0.0)),
    ]
    return cases


def _reductions() -> list[Case]:
    s = "reduction"
    near_one = Arr((32, 32), lo=0.95, hi=1.05)
    cases = [Case(f"cupy.{f}", s, (M,)) for f in (
        "sum", "mean", "std", "var", "max", "argmax", "ptp", "median")]
    cases += [Case(f"cupy.{f}", s, (NANS,)) for f in (
        "nansum", "nanmean", "nanargmax", "nanvar", "nancumsum", "nanmedian")]
    cases += [
        Case("cupy.sum [axis=0]", s, (M,), lambda f, x: f(x, axis=0)),
        Case("cupy.mean [int32, axis=1]", s, (Arr((32, 32), "int32"),), lambda f, x: f(x, axis=1)),
        Case("cupy.prod", s, (near_one,), lambda f, x: f(x, axis=1)),
        Case("cupy.cumsum", s, (M,), lambda f, x: f(x, axis=1)),
        Case("cupy.cumprod", s, (near_one,), lambda f, x: f(x, axis=1)),
        Case("cupy.all", s, (_coin((32, 32), 0.97),), lambda f, x: f(x, axis=1)),
        Case("cupy.any", s, (_coin((32, 32), 0.03),), lambda f, x: f(x, axis=1)),
        Case("cupy.count_nonzero", s, (Arr((32, 32), "int32", 0, 3),)),
        Case("cupy.nanmax", s, (NANS,), expect=SYNC, note="checks for an all-NaN slice on the host"),
        Case("cupy.average", s, (V, POS), lambda f, x, w: f(x, weights=w), expect=SYNC,
             note="checks the weights' sum for zero on the host"),
        Case("cupy.percentile", s, (V,), lambda f, x: f(x, 25.0), note="uploads q (staged)"),
        Case("cupy.histogram", s, (V,), lambda f, x: f(x, bins=16, range=(-3.0, 3.0))),
        Case("cupy.bincount", s, (Arr((N,), "int32", 0, 16),), lambda f, x: f(x, minlength=16), expect=SYNC,
             note="the output length is max(x) + 1, read on the host"),
        Case("cupy.digitize", s, (V, _sorted(16))),
        Case("cupy.corrcoef", s, (Arr((4, 64)),)),
        Case("cupy.cov", s, (Arr((4, 64)),)),
        Case("cupy.allclose", s, (_coarse(1, 2), _coarse(1, 2))),
        Case("cupy.array_equal", s, (_coarse(1, 2), _coarse(1, 2))),
    ]
    return cases


def _manipulation() -> list[Case]:
    s = "manipulation"
    pair = (M, Arr((32, 32)))
    cases = [Case(f"cupy.{f}", s, pair, lambda f, a, b: f([a, b])) for f in (
        "concatenate", "stack", "hstack", "vstack")]
    cases += [Case(f"cupy.{f}", s, (M,)) for f in (
        "transpose", "ravel", "fliplr", "rot90", "diagonal", "triu", "zeros_like")]
    cases += [Case(f"cupy.{f}", s, (V,)) for f in ("sort", "argsort", "diag")]
    cases += [
        Case("cupy.swapaxes", s, (T3,), lambda f, x: f(x, 0, 2)),
        Case("cupy.moveaxis", s, (T3,), lambda f, x: f(x, 0, -1)),
        Case("cupy.reshape", s, (M,), lambda f, x: f(x, (16, 64))),
        Case("cupy.squeeze", s, (Arr((1, 32, 1)),)),
        Case("cupy.expand_dims", s, (V,), lambda f, x: f(x, 0)),
        Case("cupy.flip", s, (M,), lambda f, x: f(x, 0)),
        Case("cupy.roll", s, (V,), lambda f, x: f(x, 5)),
        Case("cupy.tile", s, (V,), lambda f, x: f(x, (2, 3))),
        Case("cupy.repeat", s, (V,), lambda f, x: f(x, 3)),
        Case("cupy.pad", s, (M,), lambda f, x: f(x, 2)),
        Case("cupy.pad [reflect]", s, (M,), lambda f, x: f(x, 3, mode="reflect")),
        Case("cupy.take", s, (V, Arr((64,), "int32", 0, N))),
        Case("cupy.take_along_axis", s, (M, Arr((32, 8), "int32", 0, 32)), lambda f, x, i: f(x, i, axis=1)),
        Case("cupy.choose", s, (Arr((N,), "int32", 0, 3), V, W, POS), lambda f, i, a, b, c: f(i, [a, b, c])),
        Case("cupy.partition", s, (V,), lambda f, x: f(x, 10)),
        Case("cupy.argpartition", s, (V,), lambda f, x: f(x, 10), expect=SYNC,
             note="unravel_index tests (indices < 0).any() on the host (H200 probe)"),
        Case("cupy.lexsort", s, (Arr((2, N), "int32", 0, 8),)),
        Case("cupy.searchsorted", s, (_sorted(64), V)),
        Case("cupy.broadcast_to", s, (V,), lambda f, x: f(x, (4, N))),
        Case("cupy.split", s, (V,), lambda f, x: f(x, 4)),
        Case("cupy.meshgrid", s, (Arr((16,)), Arr((8,)))),
        Case("cupy.ascontiguousarray", s, (M,), lambda f, x: f(x.T)),
        Case("cupy.append", s, (V, W)),
        Case("cupy.delete", s, (V,), lambda f, x: f(x, 3), expect=SYNC,
             note="compress with a mask: nonzero counts on the host (H200 probe)"),
        Case("cupy.packbits", s, (B,)),
        Case("cupy.unpackbits", s, (Arr((64,), "uint8", 0, 256),)),
        Case("cupy.full_like", s, (V,), lambda f, x: f(x, 3.0)),
        Case("cupy.linspace", s, (), lambda f: f(0.0, 1.0, 64), note="uploads start and stop (staged)"),
        Case("cupy.eye", s, (), lambda f: f(16)),
        Case("cupy.unique", s, (Arr((N,), "int32", 0, 400),), expect=SYNC),
        Case("cupy.nonzero", s, (B,), expect=SYNC),
        Case("cupy.argwhere", s, (MB,), expect=SYNC),
        Case("cupy.flatnonzero", s, (B,), expect=SYNC),
        Case("cupy.extract", s, (B, V), expect=SYNC),
        Case("cupy.compress", s, (Arr((32,), "bool"), M), lambda f, c, x: f(c, x, axis=0), expect=SYNC),
        Case("cupy.trim_zeros", s, (Arr((N,), "int32", 0, 2),), expect=SYNC),
    ]
    return cases


def _linalg() -> list[Case]:
    s = "linear algebra"
    sq2 = (SQ, Arr((16, 16)))
    blas = "cuBLAS through cgraw's handle (interop.cupy.blas)"
    solver = "cuSOLVER through cgraw's handle (interop.cupy.solver)"
    jacobi = ("single matrix up to 32x32: gesvd/Xsyevd (they synchronise inside cuSOLVER on the H200) run as "
              "gesvdjBatched/syevjBatched with a batch of one (interop.cupy.solver); rounding differs from eager")
    vectors = ("; vectors differ from eager's by sign/phase (another algorithm), so the factorisation is "
               "checked against the input")
    cases = [
        Case("cupy.matmul", s, sq2, note=blas),
        Case("cupy.matmul [batched]", s, (Arr((4, 16, 16)), Arr((4, 16, 16))), note="gemmStridedBatchedEx"),
        Case("cupy.matmul [broadcast batch]", s, (Arr((4, 16, 16)), Arr((16, 16))),
             note="a broadcast batch: pointer arrays and sgemmBatched"),
        Case("cupy.matmul [a @ b]", s, sq2, lambda f, a, b: a @ b, note=blas),
        Case("cupy.matmul [float16]", s, (Arr((16, 16), "float16"), Arr((16, 16), "float16")), note=blas),
        Case("cupy.matmul [float64]", s, (SQ64, SQ64), note=blas),
        Case("cupy.matmul [complex64]", s, (Arr((16, 16), "complex64"), Arr((16, 16), "complex64")), note=blas),
        Case("cupy.matmul [complex128]", s, (Arr((16, 16), "complex128"), Arr((16, 16), "complex128")), note=blas),
        Case("cupy.matmul [int32]", s, (Arr((16, 16), "int32", -8, 8), Arr((16, 16), "int32", -8, 8)),
             note="CuPy multiplies integer matrices with its own kernel, not cuBLAS"),
        Case("cupy.dot", s, (SQ, Arr((16,))), note=blas),
        Case("cupy.vdot", s, (V, W), note="a reduction kernel in CuPy, not cuBLAS"),
        Case("cupy.inner", s, sq2, note=blas),
        Case("cupy.outer", s, (Arr((32,)), Arr((16,))), note="an elementwise product in CuPy"),
        Case("cupy.tensordot", s, (T3, Arr((8, 16, 5))), lambda f, a, b: f(a, b, axes=2), note=blas),
        Case("cupy.einsum", s, sq2, lambda f, a, b: f("ij,jk->ik", a, b), note=blas),
        Case("cupy.einsum [ii->i]", s, (SQ,), lambda f, a: f("ii->i", a)),
        Case("cupy.kron", s, (Arr((4, 4)), Arr((4, 4)))),
        Case("cupy.trace", s, (M,)),
        Case("cupy.cublas.gemm", s, sq2, lambda f, a, b: f("N", "T", a, b), note=blas + ", host alpha and beta"),
        Case("cupy.cublas.gemv", s, (SQ, Arr((16,))), _gemv, note=blas + ", y = 0.5 a x, written in place"),
        Case("cupy.cublas.geam", s, sq2, lambda f, a, b: f("T", "N", 1.5, a, -0.5, b), note=blas),
        Case("cupy.cublas.dot", s, (V, W), note=blas + ", the result on the device (pointer mode DEVICE)"),
        Case("cupy.cublas.nrm2", s, (V,), note=blas + ", the result on the device (pointer mode DEVICE)"),
        Case("cupy.cublas.batched_gesv", s, (_batched_well_conditioned(4, 8), Arr((4, 8))),
             note="cuBLAS getrfBatched and getrsBatched (getrs checks its arguments on the host)"),
        Case("cupy.cublas.iamax", s, (V,), expect=CUBLAS,
             note="cuBLAS isamax: not routed (its result's width follows CuPy's build)"),
        Case("cupy.linalg.norm", s, (V,)),
        Case("cupy.linalg.norm [fro]", s, (M,), lambda f, x: f(x, "fro")),
        Case("cupy.linalg.norm [ord=2]", s, (SQ,), lambda f, x: f(x, 2), compare="algorithm", note=jacobi),
        Case("cupy.linalg.solve", s, (_well_conditioned(16), Arr((16,))), note=solver),
        Case("cupy.linalg.inv", s, (_well_conditioned(16),), note=solver),
        Case("cupy.linalg.det", s, (_well_conditioned(8),), note="refused as cuBLAS by CuPy 14.2: now routed"),
        Case("cupy.linalg.slogdet", s, (_well_conditioned(16),), note="refused as cuBLAS by CuPy 14.2: now routed"),
        Case("cupy.linalg.inv [batched]", s, (_batched_well_conditioned(4, 8),),
             note="cuBLAS getrfBatched and getriBatched (routed)"),
        Case("cupy.linalg.cholesky", s, (_spd(16),), note=solver),
        Case("cupy.linalg.qr", s, (SQ,), note=solver),
        Case("cupy.linalg.eigh", s, (_symmetric(16),), compare="eigh", note=jacobi + vectors),
        Case("cupy.linalg.eigvalsh", s, (_symmetric(16),), compare="algorithm", note=jacobi),
        Case("cupy.linalg.svd", s, (SQ,), compare="svd", note=jacobi + vectors),
        Case("cupy.linalg.svd [24x16, reduced]", s, (Arr((24, 16)),), lambda f, x: f(x, full_matrices=False),
             compare="svd", note=jacobi + vectors),
        Case("cupy.linalg.svd [48x48]", s, (Arr((48, 48)),), expect=CUSOLVER,
             note="over 32x32: refused by name (up to 32x32 is routed through the Jacobi routine)"),
        Case("cupy.linalg.lstsq", s, (Arr((16, 8)), Arr((16,))), compare="algorithm", expect=SYNC,
             note="svd through Jacobi and s1[s <= cutoff] = 0 through cgraw's mask assignment; then, with m > n, "
                  "CuPy tests rank != n on the host for the residuals (H200)"),
        Case("cupy.linalg.pinv", s, (Arr((16, 8)),), compare="algorithm",
             note=jacobi + "; s[leq] = 0 through cgraw's mask assignment (interop.cupy.mask)"),
        Case("cupy.linalg.matrix_power", s, (Arr((16, 16), lo=-0.3, hi=0.3),), lambda f, x: f(x, 3), note=blas),
        Case("cupy.linalg.matrix_rank", s, (SQ,), note=jacobi),
        Case("cupy.linalg.cond", s, (_well_conditioned(16),), compare="algorithm", expect=SYNC,
             note="svd through Jacobi; then CuPy tests isnan(r).any() on the host (H200)"),
        Case("cupy.linalg.eigh [batch of one]", s, (_symmetric(16, (1,)),),
             note="stacked input: syevjBatched, routed (the hint of the single-matrix refusal)"),
        Case("cupy.linalg.svd [batch of one]", s, (Arr((1, 16, 16)),), lambda f, x: f(x, compute_uv=False),
             note="stacked input up to 32x32: gesvdjBatched, routed"),
        Case("cupy.linalg.eig", s, (_well_conditioned(8),), expect=CUSOLVER, note="Xgeev: host workspace, refused"),
        Case("cupy.linalg.eigvals", s, (_well_conditioned(8),), expect=CUSOLVER),
        Case("cupy.linalg.tensorsolve", s,
             (Maker(lambda rng: (rng.standard_normal((16, 16)) + 16 * np.eye(16)).reshape(4, 4, 16).astype(np.float32),
                    "(A+16I) as 4x4x16"), Arr((4, 4))), note=solver),
        Case("cupy.linalg.tensorinv", s,
             (Maker(lambda rng: (rng.standard_normal((16, 16)) + 16 * np.eye(16)).reshape(4, 4, 16).astype(np.float32),
                    "(A+16I) as 4x4x16"),), note=solver),
    ]
    return cases


def _fft() -> list[Case]:
    s = "fft"
    c129 = Arr((129,), "complex64")
    cases = [Case(f"cupy.fft.{f}", s, (V,)) for f in ("fft", "rfft", "ihfft", "fftshift", "ifftshift")]
    cases += [Case(f"cupy.fft.{f}", s, (C64,)) for f in ("ifft",)]
    cases += [Case(f"cupy.fft.{f}", s, (c129,)) for f in ("irfft", "hfft")]
    cases += [Case(f"cupy.fft.{f}", s, (M,)) for f in ("fft2", "rfft2")]
    cases += [Case(f"cupy.fft.{f}", s, (CIMG,)) for f in ("ifft2",)]
    cases += [Case(f"cupy.fft.{f}", s, (T3,)) for f in ("fftn", "rfftn")]
    cases += [
        Case("cupy.fft.ifftn", s, (Arr((4, 8, 16), "complex64"),)),
        Case("cupy.fft.irfft2", s, (Arr((32, 17), "complex64"),)),
        Case("cupy.fft.irfftn", s, (Arr((4, 8, 9), "complex64"),)),
        Case("cupy.fft.fft [complex64]", s, (C64,)),
        Case("cupy.fft.fft [float64]", s, (V64,)),
        Case("cupy.fft.fft [n=300]", s, (V,), lambda f, x: f(x, n=300)),
        Case("cupy.fft.fftfreq", s, (), lambda f: f(N, 0.1)),
        Case("cupy.fft.rfftfreq", s, (), lambda f: f(N, 0.1)),
    ]
    return cases


def _random() -> list[Case]:
    s = "random"
    u01 = Law(lo=0.0, hi=1.0, mean=0.5, std=(1 / 12) ** 0.5)
    std_normal = Law(mean=0.0, std=1.0)

    def r(name, call, law, inputs=(), **kw):
        return Case(f"cupy.random.{name}", s, inputs, call, compare="random", law=law, **kw)

    def uncovered(name, call, inputs=()):
        return Case(f"cupy.random.{name}", s, inputs, call, compare="random", law=Law(), expect=RNG)

    def gen(name, call, law):
        return Case(f"cupy.random.Generator.{name}", s, (), call, setup=lambda ns: (ns.cp.random.default_rng(0),),
                    compare="random", law=law, note="CuPy's Generator API: its bit generator's state is on the device")

    return [
        r("random", lambda f: f(RSIZE), u01),
        r("random [float32]", lambda f: f(RSIZE, dtype=np.float32), u01),
        r("random_sample", lambda f: f(RSIZE), u01),
        r("rand", lambda f: f(64, 64), u01),
        r("randn", lambda f: f(64, 64), std_normal),
        r("standard_normal", lambda f: f(RSIZE, dtype=np.float32), std_normal),
        r("normal", lambda f: f(2.0, 3.0, RSIZE), Law(mean=2.0, std=3.0)),
        r("normal [array loc]", lambda f, loc: f(loc, 1.0), Law(mean=0.0, std=1.0, minus=0), (Arr((RSIZE,)),)),
        # closed: a uniform draw may round up to its high end, as NumPy documents
        r("uniform", lambda f: f(-2.0, 3.0, RSIZE), Law(lo=-2.0, hi=3.0, closed=True, mean=0.5, std=5 / 12 ** 0.5)),
        r("randint", lambda f: f(0, 10, RSIZE), Law(lo=0, hi=10, mean=4.5, std=(99 / 12) ** 0.5, integer=True)),
        r("random_integers", lambda f: f(1, 6, RSIZE),
          Law(lo=1, hi=6, closed=True, mean=3.5, std=(35 / 12) ** 0.5, integer=True)),
        r("choice", lambda f: f(5, RSIZE), Law(lo=0, hi=5, mean=2.0, std=2 ** 0.5, integer=True)),
        r("choice [p]", lambda f, p: f(5, RSIZE, p=p), Law(lo=0, hi=5, integer=True), (_probabilities(5),)),
        r("choice [array a]", lambda f, a: f(a, RSIZE), Law(support=0), (Arr((16,), "int32", -100, 100),)),
        r("standard_exponential", lambda f: f(RSIZE), Law(lo=0.0, mean=1.0, std=1.0)),
        r("exponential", lambda f: f(2.0, RSIZE), Law(lo=0.0, mean=2.0, std=2.0)),
        # rejection samplers with per-element counter streams (rng.kernels.SAMPLERS)
        r("gamma", lambda f: f(2.0, 1.5, RSIZE), Law(lo=0.0, mean=3.0, std=1.5 * 2 ** 0.5)),
        r("standard_gamma", lambda f: f(2.0, RSIZE), Law(lo=0.0, mean=2.0, std=2 ** 0.5)),
        r("standard_gamma [shape < 1]", lambda f: f(0.5, RSIZE, dtype=np.float32),
          Law(lo=0.0, mean=0.5, std=0.5 ** 0.5)),
        # Beta(2, 3): mean 2/5, variance ab / ((a + b)^2 (a + b + 1)) = 1/25
        r("beta", lambda f: f(2.0, 3.0, RSIZE), Law(lo=0.0, hi=1.0, closed=True, mean=0.4, std=0.2)),
        r("poisson", lambda f: f(3.0, RSIZE), Law(lo=0, mean=3.0, std=3 ** 0.5, integer=True)),
        r("poisson [lam 100]", lambda f: f(100.0, RSIZE), Law(lo=0, mean=100.0, std=10.0, integer=True)),
        r("binomial", lambda f: f(10, 0.5, RSIZE), Law(lo=0, hi=10, closed=True, mean=5.0, std=2.5 ** 0.5,
                                                       integer=True)),
        r("binomial [n p >= 10]", lambda f: f(1000, 0.7, RSIZE), Law(lo=0, hi=1000, closed=True, mean=700.0,
                                                                      std=210 ** 0.5, integer=True)),
        uncovered("vonmises", lambda f: f(0.0, 1.0, RSIZE)),
        # exp of cgraw's normal: mean exp(s^2/2), std sqrt((exp(s^2) - 1) exp(s^2)) for s = 0.5
        r("lognormal", lambda f: f(0.0, 0.5, RSIZE), Law(lo=0.0, mean=math.exp(0.125),
                                                         std=math.sqrt((math.exp(0.25) - 1) * math.exp(0.25)))),
        # a permuted arange(N): its mean and standard deviation are exactly the law's
        r("permutation", lambda f: f(N), Law(lo=0, hi=N, integer=True, distinct=True, mean=(N - 1) / 2,
                                             std=((N * N - 1) / 12) ** 0.5)),
        r("shuffle", lambda f, x: (f(x), x)[1], Law(support=0, distinct=True), (V,)),
        gen("random", lambda f, g: f(g, RSIZE), u01),
        gen("standard_normal", lambda f, g: f(g, RSIZE), std_normal),
        gen("integers", lambda f, g: f(g, 0, 10, RSIZE), Law(lo=0, hi=10, mean=4.5, std=(99 / 12) ** 0.5,
                                                              integer=True)),
    ]


def _ndimage() -> list[Case]:
    s = "ndimage"
    p = "cupyx.scipy.ndimage."
    cases = [Case(p + f, s, (IMG,), lambda f, x: f(x, size=3)) for f in (
        "uniform_filter", "median_filter", "minimum_filter", "maximum_filter", "grey_erosion", "grey_dilation",
        "morphological_gradient")]
    cases += [Case(p + f, s, (IMG,), lambda f, x: f(x, 1.5), note="weights staged") for f in (
        "gaussian_filter", "gaussian_filter1d", "gaussian_laplace")]
    cases += [Case(p + f, s, (IMG,), note="weights staged") for f in ("sobel", "prewitt", "laplace")]
    cases += [Case(p + f, s, (Arr((32, 32), "bool"),), expect=SYNC,
                   note="int(count_nonzero(structure)) on the host (H200 probe)") for f in (
        "binary_erosion", "binary_closing")]
    cases += [
        Case(p + "correlate1d", s, (IMG, TAPS), lambda f, x, w: f(x, w, axis=0)),
        Case(p + "convolve1d", s, (IMG, TAPS), lambda f, x, w: f(x, w, axis=1)),
        Case(p + "correlate", s, (IMG, W3)),
        Case(p + "convolve", s, (IMG, W3), lambda f, x, w: f(x, w, mode="nearest")),
        Case(p + "uniform_filter1d", s, (IMG,), lambda f, x: f(x, 5)),
        Case(p + "percentile_filter", s, (IMG,), lambda f, x: f(x, 25, size=3)),
        Case(p + "rank_filter", s, (IMG,), lambda f, x: f(x, 2, size=3)),
        Case(p + "zoom", s, (IMG,), lambda f, x: f(x, 1.5, order=1), note="staged"),
        Case(p + "shift", s, (IMG,), lambda f, x: f(x, (1.5, -0.5), order=1), note="staged"),
        Case(p + "rotate", s, (IMG,), lambda f, x: f(x, 30.0, reshape=False, order=1), expect=SYNC,
             note="its upload is staged; then affine_transform reads the offset with float() (H200 probe)"),
        Case(p + "affine_transform", s, (IMG, Arr((2, 2), lo=0.8, hi=1.2)), lambda f, x, m: f(x, m, order=1),
             note="the default offset=0.0 is uploaded with cupy.asarray (staged)"),
        Case(p + "map_coordinates", s, (IMG, Arr((2, N), lo=0.0, hi=31.0)), lambda f, x, c: f(x, c, order=1)),
        Case(p + "spline_filter", s, (IMG,)),
        Case(p + "fourier_gaussian", s, (CIMG,), lambda f, x: f(x, 1.0)),
        Case(p + "fourier_shift", s, (CIMG,), lambda f, x: f(x, 1.5)),
        Case(p + "label", s, (Arr((32, 32), "bool"),), expect=SYNC, note="returns the number of labels as an int"),
        Case(p + "sum_labels", s, (IMG, Arr((32, 32), "int32", 0, 4)), expect=SYNC,
             note="input[labels != 0]: boolean-mask indexing counts on the host (H200 probe)"),
        Case(p + "center_of_mass", s, (Arr((32, 32), lo=0.0, hi=1.0),)),
        Case(p + "distance_transform_edt", s, (Arr((32, 32), "bool"),)),
    ]
    return cases


def _signal() -> list[Case]:
    s = "signal"
    p = "cupyx.scipy.signal."
    t = Arr((N,), lo=0.0, hi=1.0)
    h9 = Arr((9,))
    cases = [Case(p + f, s, (IMG, W3)) for f in ("convolve2d",)]
    cases += [Case(p + f, s, (V, h9)) for f in ("convolve", "correlate", "fftconvolve")]
    cases += [Case(p + f, s, (V, W), lambda f, x, y: f(x, y, nperseg=64)) for f in ("csd",)]
    cases += [Case(p + f, s, (V,), lambda f, x: f(x, nperseg=64)) for f in ("welch", "stft")]
    cases += [
        Case(p + "oaconvolve", s, (V, Arr((31,)))),
        Case(p + "lfilter", s, (Arr((3,)), DEN, V)),
        Case(p + "sosfilt", s, (SOS, V)),
        Case(p + "filtfilt", s, (Arr((3,)), DEN, V), expect=SYNC,
             note="lfilter_zi: cupy.where(a == 0) (nonzero) on the host (H200 probe)"),
        Case(p + "medfilt", s, (V,), lambda f, x: f(x, 5)),
        Case(p + "medfilt2d", s, (IMG,), lambda f, x: f(x, 3)),
        Case(p + "order_filter", s, (IMG, Maker(lambda rng: np.ones((3, 3), np.float32), "ones(3,3)")),
             lambda f, x, d: f(x, d, 4), expect=SYNC,
             note="rank_filter tests footprint.any() on the host (H200 probe)"),
        Case(p + "wiener", s, (IMG,)),
        Case(p + "detrend", s, (V,), expect=SYNC,
             note="cupy.unique of the breakpoints (boolean mask) on the host (H200 probe)"),
        Case(p + "hilbert", s, (V,)),
        Case(p + "resample", s, (V,), lambda f, x: f(x, 128)),
        Case(p + "resample_poly", s, (V,), lambda f, x: f(x, 2, 3), expect=SYNC,
             note="firwin checks its cutoff range on the host (H200 probe)"),
        Case(p + "upfirdn", s, (h9, V), lambda f, h, x: f(h, x, 2, 3)),
        Case(p + "decimate", s, (V,), lambda f, x: f(x, 4), expect=SYNC,
             note="iirfilter checks Wn on the host with cupy.any (H200 probe)"),
        Case(p + "savgol_filter", s, (V,), lambda f, x: f(x, 7, 2), compare="algorithm", expect=SYNC,
             note="coefficients: lstsq of a 3x7 matrix through gesvdjBatched; then mode='interp' fits the edges "
                  "with polyfit, a tall lstsq whose rank CuPy compares on the host (H200)"),
        Case(p + "periodogram", s, (V,)),
        Case(p + "chirp", s, (t,), lambda f, x: f(x, 1.0, 1.0, 10.0)),
        Case(p + "gausspulse", s, (t,), lambda f, x: f(x - 0.5, fc=5.0)),
        Case(p + "cspline1d", s, (V,)),
        Case(p + "find_peaks", s, (V,), expect=SYNC),
        Case(p + "argrelmax", s, (V,), expect=SYNC),
        Case(p + "get_window", s, (), lambda f: f("hann", 64)),
    ]
    return cases


def _special() -> list[Case]:
    s = "special"
    p = "cupyx.scipy.special."
    half = Arr((N,), lo=2.0, hi=6.0)
    m01 = Arr((N,), lo=0.0, hi=0.9)
    order = Arr((N,), "int32", 0, 4)
    unary = {V: ("erf", "erfc", "erfcx", "expit", "i1", "j0", "j1", "ndtr"),
             POS: ("gamma", "gammaln", "digamma", "y0", "k0", "exp1", "expi", "entr", "lambertw", "sici"),
             UNIT: ("erfinv",),
             PROB: ("logit", "ndtri"),
             m01: ("ellipk",)}
    cases = [Case(p + f, s, (spec,)) for spec, names in unary.items() for f in names]
    binary = {(POS, Arr((N,), lo=0.5, hi=4.0)): ("beta", "betaln", "gammainc", "gammaincc", "xlogy", "kl_div"),
              (POS, V): ("huber", "pseudo_huber")}
    cases += [Case(p + f, s, specs) for specs, names in binary.items() for f in names]
    cases += [
        Case(p + "erfcinv", s, (Arr((N,), lo=0.1, hi=1.9),)),
        Case(p + "betainc", s, (POS, Arr((N,), lo=0.5, hi=4.0), Arr((N,), lo=0.0, hi=1.0))),
        Case(p + "polygamma", s, (order, POS)),
        Case(p + "yn", s, (order, POS)),
        Case(p + "zeta", s, (Arr((N,), lo=1.5, hi=4.0), POS)),
        Case(p + "binom", s, (Arr((N,), lo=5.0, hi=20.0), Arr((N,), lo=0.0, hi=5.0))),
        Case(p + "boxcox", s, (POS,), lambda f, x: f(x, 0.5)),
        Case(p + "ellipj", s, (V, m01)),
        Case(p + "multigammaln", s, (half,), lambda f, a: f(a, 3), expect=SYNC, note="checks its domain on the host"),
        Case(p + "spherical_yn", s, (order, POS)),
        Case(p + "softmax", s, (M,), lambda f, x: f(x, axis=1)),
        Case(p + "log_softmax", s, (M,), lambda f, x: f(x, axis=1),
             note="x_max[~isfinite(x_max)] = 0: CuPy counts the mask on the host; cgraw assigns with copyto(where=)"),
        Case(p + "logsumexp", s, (M,), lambda f, x: f(x, axis=1),
             note="a_max[~isfinite(a_max)] = 0: CuPy counts the mask on the host; cgraw assigns with copyto(where=)"),
        Case(p + "erf [float64]", s, (V64,)),
    ]
    return cases


def _sparse() -> list[Case]:
    s = "sparse"
    p = "cupyx.scipy.sparse."
    x, xs, dense = Arr((SPARSE_SHAPE[1],)), Arr((SPARSE_SHAPE[1], 8)), Arr(SPARSE_SHAPE)
    return [
        Case(p + "csr_matrix.dot", s, SP_INPUTS + (x,), setup=_csr_setup,
             note="matrix @ vector; spMV routed (H200)"),
        Case(p + "csr_matrix.__matmul__", s, SP_INPUTS + (xs,), setup=_csr_setup,
             note="matrix @ dense matrix; spMM routed (H200)"),
        Case(p + "csr_matrix.multiply", s, SP_INPUTS + (dense,), setup=_csr_setup, note="by a dense matrix"),
        Case(p + "csr_matrix.__mul__", s, SP_INPUTS, lambda f, a: f(a, 2.0), setup=_csr_setup, note="by a scalar"),
        Case(p + "csr_matrix.power", s, SP_INPUTS, lambda f, a: f(a, 2), setup=_csr_setup),
        Case(p + "csr_matrix.toarray", s, SP_INPUTS, setup=_csr_setup, expect=SYNC,
             note="xcsr2coo routed (H200), then coo_matrix.sum_duplicates tests "
                  "diff[1:].all() on the host"),
        Case(p + "csr_matrix.sum", s, SP_INPUTS, lambda f, a: f(a, axis=1), setup=_csr_setup,
             note="spMV routed (H200)"),
        Case(p + "csr_matrix.diagonal", s, SP_INPUTS, setup=_csr_setup),
        Case(p + "csr_matrix.__add__", s, SP_INPUTS, lambda f, a: f(a, a), setup=_csr_setup, expect=CUSPARSE,
             note="csrgeam2 sizes its result on the host: refused by name"),
        Case(p + "csc_matrix.dot", s, (Arr((SPARSE_SHAPE[0],)),) + SP_INPUTS,
             setup=lambda ns, v, *parts: (_csr(ns, *parts).T.tocsc(), v),
             note="the CSR's transpose as CSC @ vector; spMV routed (H200)"),
        Case(p + "coo_matrix.dot", s, SP_INPUTS + (x,), setup=lambda ns, *a: (_csr(ns, *a[:3]).tocoo(), a[3]),
             expect=SYNC, note="tocsr's sum_duplicates tests diff[1:].all() on the host (H200 probe)"),
    ]


def cases() -> list[Case]:
    """Every case, in the order they run."""
    return (_elementwise() + _reductions() + _manipulation() + _linalg() + _fft() + _random() + _ndimage()
            + _signal() + _special() + _sparse())
