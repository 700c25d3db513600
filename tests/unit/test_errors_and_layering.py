"""CPU tier: the CUDA call layer's error mapping, import hygiene and the layered import stack."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

from cgraw import _cuda
from cgraw.errors import CaptureError, CudaError, OutOfMemoryError

ROOT = pathlib.Path(__file__).resolve().parents[2]
R = _cuda.CUresult


def test_check_returns_values():
    assert _cuda.check((R.CUDA_SUCCESS,), "cuX") is None
    assert _cuda.check((R.CUDA_SUCCESS, 7), "cuX") == 7
    assert _cuda.check((R.CUDA_SUCCESS, 7, 8), "cuX") == (7, 8)


@pytest.mark.parametrize(
    "code, cls, hint_word",
    [
        (R.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, CaptureError, "host synchronisation"),
        (R.CUDA_ERROR_STREAM_CAPTURE_UNJOINED, CaptureError, "joined"),
        (R.CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, CaptureError, "thread"),
        (R.CUDA_ERROR_OUT_OF_MEMORY, OutOfMemoryError, "memory"),
        (R.CUDA_ERROR_INVALID_VALUE, CudaError, ""),
    ],
)
def test_check_raises_named_errors(code, cls, hint_word):
    with pytest.raises(cls) as ei:
        _cuda.check((code, None), "cuStreamEndCapture")
    e = ei.value
    assert type(e) is cls
    assert e.call == "cuStreamEndCapture" and e.code == int(code) and e.name == code.name
    assert str(e).startswith(f"cuStreamEndCapture: {code.name}")
    assert hint_word in e.hint


def test_out_of_memory_is_memory_error():
    e = _cuda.make_error(R.CUDA_ERROR_OUT_OF_MEMORY, "cuMemAlloc")
    assert isinstance(e, MemoryError) and isinstance(e, CudaError)


def test_unknown_code_still_named():
    e = _cuda.make_error(123456, "cuFoo")
    assert "123456" in e.name and e.call == "cuFoo"


def _python(code: str, timeout: int = 120) -> str:
    """Run ``code`` in a fresh interpreter from the repository root: its stripped output, once it
    exits with status 0."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_makes_no_driver_call():
    code = (
        "import sys, cgraw, allocator\n"
        "from cgraw import _cuda\n"
        "assert not _cuda._initialised and _cuda._init_error is None\n"
        "assert 'torch' not in sys.modules and 'cupy' not in sys.modules\n"
        "print('ok')\n"
    )
    assert _python(code) == "ok"


def test_cgraw_imports_and_calls_without_operator_call_as_on_python_3_10():
    """``operator.call`` is Python 3.11's; cgraw supports 3.10. With it removed before the import,
    the modules that call bound methods in C loops import and call them alike."""
    code = (
        "import operator\n"
        "del operator.call\n"
        "import importlib\n"
        "mods = ['cgraw.trees.calls', 'cgraw.trees.recording', 'cgraw.interop.torch.kernel_state']\n"
        "for name in mods:\n"
        "    f = importlib.import_module(name)._call\n"
        "    assert f is not getattr(operator, 'call', None) and f([3, 1, 2].copy) == [3, 1, 2], name\n"
        "    assert list(map(f, [(7).__neg__, 'ab'.upper])) == [-7, 'AB'], name\n"
        "print('ok')\n"
    )
    assert _python(code) == "ok"


def test_first_use_without_driver_gives_one_clear_error():
    ok, reason = _cuda.driver_available()
    if ok:
        pytest.skip("a CUDA driver is present on this machine")
    import cgraw

    with pytest.raises(cgraw.CudaUnavailableError, match="no CUDA driver|no CUDA device"):
        cgraw.Device(0).set_current()
    with pytest.raises(cgraw.CudaUnavailableError):
        cgraw.DevicePool(0).malloc(1024)


def test_allocator_imports_alone():
    # cuda-bindings 12.9's .pth file imports the ``cuda`` namespace at start-up: only new modules count
    code = ("import sys\nbefore = set(sys.modules)\nimport allocator\n"
            "assert not any(m == 'cgraw' or m.startswith('cuda') for m in set(sys.modules) - before)\nprint('ok')")
    assert _python(code, timeout=60) == "ok"


# The one-way stack: a module may import only from its own or lower layers.
LAYER = {
    "allocator": 0,
    "cgraw.errors": 1, "cgraw._cuda.defer": 1, "cgraw._cuda": 1, "cgraw._cuda.compat": 1, "cgraw._cuda.graphs": 1,
    "cgraw.dlpack.structs": 1, "cgraw.dlpack.capsules": 1, "cgraw._cuda.kernels": 1,
    "cgraw.interop.torch.private_api": 1, "cgraw.rng.plan": 1, "cgraw.rng.kernels": 1, "cgraw.rng.reference": 1,
    "cgraw.rebind.scan": 1, "cgraw._cuda.conditional": 1, "cgraw.control.plan": 1, "cgraw.control.kernels": 1,
    "cgraw.runtime.device": 2, "cgraw.runtime.stream": 3, "cgraw.rng.device": 3,
    "cgraw.runtime.memory": 4, "cgraw.rebind.ranges": 4, "cgraw.dlpack.tensor": 5,
    "cgraw.runtime.graph": 6, "cgraw.trees.frameworks": 6, "cgraw.trees.arrays": 6, "cgraw.trees.buckets": 6, "cgraw.trees.calls": 6, "cgraw.trees.input_plan": 6, "cgraw.trees.recording": 6,
    "cgraw.trees.nodes": 6, "cgraw.trees.config": 6, "cgraw.trees.outputs": 6, "cgraw.trees.pool": 6, "cgraw.trees.manager": 6, "cgraw.trees.growth": 6, "cgraw.trees.prepared": 6, "cgraw.trees.autograd": 6,
    "cgraw.interop": 7, "cgraw.interop.cupy.blas": 7, "cgraw.interop.torch.partitions": 7,
    "cgraw.interop.torch.whole_graph": 7,
    "cgraw.runtime.capture": 8, "cgraw.trees.cuda_backend": 8, "cgraw.rebind.proof": 8, "cgraw.trees.warmup": 8,
    "cgraw.control.flow": 8, "cgraw.control.nodes": 8, "cgraw.control.hops": 8,
    "cgraw.trees.graphed": 9, "cgraw.trees.callables": 9, "cgraw.interop.torch.backend": 9,
    "cgraw": 99,
    # the subpackages' __init__ modules hold their docstring only
    "cgraw.runtime": 1, "cgraw.dlpack": 1, "cgraw.rng": 1, "cgraw.rebind": 1, "cgraw.trees": 1, "cgraw.control": 1,
    "cgraw.interop.torch": 7, "cgraw.interop.cupy": 7,
}


def _layer(mod: str) -> int | None:
    parts = mod.split(".")
    for i in range(len(parts), 0, -1):
        key = ".".join(parts[:i])
        if key in LAYER:
            return LAYER[key]
    return None


def _in_cuda_package(name: str) -> bool:
    return name == "cgraw._cuda" or name.startswith("cgraw._cuda.")


def _modules():
    for path in sorted((ROOT / "cgraw").rglob("*.py")) + sorted((ROOT / "allocator").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts)
        if name.endswith(".__init__"):
            name = name[: -len(".__init__")]
        yield name, path


MODULE_NAMES = {name for name, _ in _modules()}


@pytest.mark.parametrize("name,path", list(_modules()), ids=lambda x: str(x) if isinstance(x, str) else "")
def test_import_stack(name, path):
    tree = ast.parse(path.read_text())
    mine = _layer(name)
    assert mine is not None, f"{name} has no layer in the table"
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # from cgraw.trees import manager -> cgraw.trees.manager; from cgraw.errors import X -> cgraw.errors
            targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULE_NAMES else node.module
                       for a in node.names]
        for t in targets:
            if name.startswith("allocator"):
                assert not t.startswith(("cgraw", "cuda", "torch", "cupy")), f"{name} imports {t}"
            if t.startswith("cuda.bindings"):
                assert _in_cuda_package(name), f"only the cgraw._cuda package may import cuda.bindings ({name} does)"
            if t in ("torch", "cupy") or t.startswith(("torch.", "cupy.")):
                assert name.startswith("cgraw.interop") or name == "cgraw.runtime.memory", f"{name} imports {t} eagerly"
            theirs = _layer(t)
            if theirs is not None and name != "cgraw":
                assert theirs <= mine, f"{name} (layer {mine}) imports {t} (layer {theirs})"


def test_only_the_cuda_layer_reaches_the_bindings():
    """``cuda.bindings`` objects (``_cuda.drv``, ``_cuda._rt``) are used in the ``cgraw/_cuda/`` package only."""
    for name, path in _modules():
        if not _in_cuda_package(name):
            text = path.read_text()
            assert "_cuda.drv" not in text and "_cuda._rt" not in text, f"{name} reaches into cuda.bindings"


def test_no_private_keyword_arguments_between_modules():
    """Modules talk through named methods (``capture.for_tree``), not private keyword arguments."""
    for name, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                bad = [k.arg for k in node.keywords if k.arg and k.arg.startswith("_")]
                assert not bad, f"{name}:{node.lineno} passes private keyword(s) {bad}"


def test_module_docstrings_quote_the_layer_table():
    """A module whose docstring names its layer ("Layer L6") names the one in ``LAYER``."""
    import re

    for name, path in _modules():
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        m = re.search(r"Layer L(\d+)", doc)
        if m is not None:
            assert int(m.group(1)) == _layer(name), f"{name} says layer {m.group(1)}, the table {_layer(name)}"


def test_modules_stay_small():
    for name, path in _modules():
        n = len(path.read_text().splitlines())
        limit = 450 if name.startswith("cgraw") else 650  # modules of cgraw/ stay short: ~450 lines at most
        assert n <= limit, f"{name} has {n} lines; split it"
