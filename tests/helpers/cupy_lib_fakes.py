"""Fakes shared by the CPU tiers of CuPy's library routers (tests/unit/test_cupy_blas_cpu.py,
test_cupy_solver_cpu.py, test_cupy_sparse_cpu.py): a ctypes library that records its calls, CuPy's
``Device``, the routers' fresh module state, and a call made from a CuPy frame.

Imported by those tests; tests/conftest.py puts tests/helpers on ``sys.path``.
"""

from __future__ import annotations

from cgraw.interop.cupy import route as R


class FakeFn:
    """One entry point of a ``FakeDll``: records (symbol, args), fills the handle a create call makes, runs
    the dll's host emulation of it if any, writes its outputs, and returns the dll's status for it."""

    def __init__(self, dll, name):
        self.dll, self.name, self.argtypes, self.restype = dll, name, None, None

    def __call__(self, *args):
        self.dll.calls.append((self.name, args))
        if self.dll.creates(self.name):  # the handle (or, for cuSOLVER, a Jacobi info structure)
            args[0]._obj.value = self.dll.next_handle
            self.dll.next_handle += 0x100
        impl = self.dll.impl.get(self.name)
        if impl is not None:  # a host emulation of the routine (the Jacobi substitution's tests)
            impl(*args)
        for a in args:  # outputs: the routine writes them
            obj = getattr(a, "_obj", None)
            if isinstance(obj, self.dll.out_types):
                obj.value = self.dll.out_value
        return self.dll.status.get(self.name, 0)


class FakeDll:
    """Exports every name that starts with ``prefix``; records every call as (symbol, args)."""

    def __init__(self, prefix: str, creates, next_handle: int, out_value: int = 0, out_types: tuple = ()):
        self.prefix, self.creates, self.next_handle = prefix, creates, next_handle
        self.out_value, self.out_types = out_value, out_types
        self.calls, self.status, self.impl = [], {}, {}

    def __getattr__(self, name):
        if name.startswith("_") or not name.startswith(self.__dict__["prefix"]):
            raise AttributeError(name)
        fn = FakeFn(self, name)
        setattr(self, name, fn)
        return fn

    def named(self, name):
        return [args for n, args in self.calls if n == name]


class FakeDevice:
    """``cupy.cuda.Device``: a context manager."""

    def __init__(self, ordinal=0):
        self.ordinal, self.compute_capability = ordinal, "90"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def fresh_routing(monkeypatch, module) -> None:
    """``module`` (interop.cupy.blas, interop.cupy.solver, interop.cupy.sparse) gets a fresh ``Routing`` and library cache."""
    routing = R.Routing()
    for name, value in (("_routing", routing), ("_routers", routing.routers), ("_patches", routing.patches),
                        ("_idle", routing.idle), ("_library_cache", [])):
        monkeypatch.setattr(module, name, value)


def call_from_cupy(module: str, fn_name: str, call):
    """Run ``call`` from a function defined in ``module`` (as CuPy's frames look)."""
    ns = {"__name__": module, "call": call}
    exec(f"def {fn_name}():\n    return call()\n", ns)
    return ns[fn_name]()
