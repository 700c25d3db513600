"""``python3 -m tools.probes.rebind_probe`` (from the repository root): can a recording read an input
in place?

A feasibility probe of zero-copy inputs (``cgraw.rebind.scan``), not a benchmark. For a few kernels that read a
tensor captured at one address ("the placeholder"), it reads the kernel nodes' argument bytes,
finds the words that point into the placeholder (``cgraw.rebind.scan.scan``), rewrites them to another
tensor's address on the executable graph (``cuGraphExecKernelNodeSetParams``), replays, and
compares with eager on that other tensor. Cases: torch elementwise (contiguous and strided),
a torch reduction, a torch matmul (cuBLAS), a CuPy ElementwiseKernel, and a CuPy RawKernel that
reads its input through a pointer table in device memory (the scan cannot see it: the probe
expects zero words there, and a wrong result if the table is not rewritten). Writes
``rebind_probe.json`` to ``$OUT`` (or the current directory).
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def _rebind_case(name, make_inputs, body, torch, cgraw):
    from cgraw import _cuda
    from cgraw.rebind.scan import Placeholder, Plan, scan

    ph, other = make_inputs()
    with cgraw.capture() as g:
        out = body(ph)
    nodes = _cuda.graph_get_nodes(g._graph)
    kernel_type = _cuda.NodeType.CU_GRAPH_NODE_TYPE_KERNEL
    kernels, params = [], {}
    for i, n in enumerate(nodes):
        if _cuda.graph_node_get_type(n) == kernel_type:
            p, args = _cuda.graph_kernel_node_args(n)
            params[i] = (n, p, args)
            kernels.append((i, args))
    ptr = ph.data_ptr() if hasattr(ph, "data_ptr") else ph.data.ptr
    nbytes = ph.numel() * ph.element_size() if hasattr(ph, "numel") else ph.nbytes
    plan = Plan(*scan(kernels, [Placeholder(0, ptr, nbytes)]))
    new = other.data_ptr() if hasattr(other, "data_ptr") else other.data.ptr
    for i in plan.nodes_of(0):
        n, p, args = params[i]
        patched = plan.patch(i, [a for _, a in args], {0: new})
        _cuda.graph_exec_kernel_node_set_args(g._exec, n, p, patched)
    g.replay()
    _cuda.ctx_synchronize()
    want = body(other)
    if hasattr(want, "cpu"):
        equal = bool(torch.equal(out, want))
        diff = float((out.double() - want.double()).abs().max()) if out.numel() else 0.0
    else:
        import cupy as cp

        equal = bool(cp.array_equal(out, want))
        diff = float(cp.abs(out.astype(cp.float64) - want.astype(cp.float64)).max())
    return {"case": name, "kernel_nodes": len(kernels), "words": len(plan.words),
            "nodes_rebound": plan.nodes_of(0), "equal_after_rebind": equal, "max_abs_diff": diff}


def _timing(torch, cgraw) -> dict:
    """Host cost of re-pointing one kernel node, three ways, next to a memcpy node's re-point in
    the same run; and whether a disabled memcpy node (``cuGraphNodeSetEnabled``) stops copying."""
    import ctypes
    import time

    from cuda.bindings import driver as drv

    from cgraw import _cuda
    from cgraw.rebind.scan import Placeholder, Plan, scan

    n_iter = 4000
    x, x2 = torch.randn(4096, device="cuda"), torch.randn(4096, device="cuda")
    ph = torch.empty_like(x)
    with cgraw.capture() as g:
        ph.copy_(x)
        y = (ph * 2 + 1).sin() + ph
    nodes = _cuda.graph_get_nodes(g._graph)
    kt = _cuda.NodeType.CU_GRAPH_NODE_TYPE_KERNEL
    kernels, params = [], {}
    for i, nd in enumerate(nodes):
        if _cuda.graph_node_get_type(nd) == kt:
            p, args = _cuda.graph_kernel_node_args(nd)
            params[i] = (nd, p, args)
            kernels.append((i, args))
    plan = Plan(*scan(kernels, [Placeholder(0, ph.data_ptr(), ph.numel() * 4)]))
    rows = {"kernel_nodes": len(kernels), "nodes_reading_input": plan.nodes_of(0)}
    i0 = plan.nodes_of(0)[0]
    nd, p, args = params[i0]
    addrs = [x.data_ptr(), x2.data_ptr()]

    def per_call(f):
        for k in range(200):
            f(addrs[k & 1])
        t0 = time.perf_counter()
        for k in range(n_iter):
            f(addrs[k & 1])
        return (time.perf_counter() - t0) / n_iter * 1e6

    raw = [a for _, a in args]
    rows["us_python_build_each_call"] = per_call(
        lambda a: _cuda.graph_exec_kernel_node_set_args(g._exec, nd, p, plan.patch(i0, raw, {0: a})))
    # prebuilt: our argument buffers and one CUDA_KERNEL_NODE_PARAMS, only the words rewritten
    bufs = [ctypes.create_string_buffer(bytes(a), max(len(a), 1)) for a in raw]
    table = (ctypes.c_void_p * len(bufs))(*[ctypes.addressof(b) for b in bufs])
    words = [ctypes.c_uint64.from_address(ctypes.addressof(bufs[w.param]) + w.offset)
             for w in plan.by_node[i0]]
    deltas = [w.delta for w in plan.by_node[i0]]
    q = drv.CUDA_KERNEL_NODE_PARAMS()
    if int(p.func) != 0:
        q.func = p.func
    else:
        q.kern, q.ctx = p.kern, p.ctx
    q.gridDimX, q.gridDimY, q.gridDimZ = p.gridDimX, p.gridDimY, p.gridDimZ
    q.blockDimX, q.blockDimY, q.blockDimZ = p.blockDimX, p.blockDimY, p.blockDimZ
    q.sharedMemBytes = p.sharedMemBytes
    q.kernelParams = ctypes.addressof(table)
    setp = drv.cuGraphExecKernelNodeSetParams
    ex = g._exec

    def prebuilt(a):
        for w, d in zip(words, deltas):
            w.value = a + d
        setp(ex, nd, q)

    rows["us_prebuilt_cuda_python"] = per_call(prebuilt)
    lib = ctypes.CDLL("libcuda.so.1")
    fn = getattr(lib, "cuGraphExecKernelNodeSetParams_v2", None) or lib.cuGraphExecKernelNodeSetParams
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    exi, ndi, qp = _cuda.native(ex), _cuda.native(nd), q.getPtr()

    def direct(a):
        for w, d in zip(words, deltas):
            w.value = a + d
        err = fn(exi, ndi, qp)
        if err:
            raise RuntimeError(f"cuGraphExecKernelNodeSetParams_v2 returned {err}")

    rows["us_prebuilt_ctypes"] = per_call(direct)
    memcpys = g.memcpy_nodes()
    mnode = memcpys.get((ph.data_ptr(), x.data_ptr()))
    rows["memcpy_node_found"] = mnode is not None
    if mnode is not None:
        setter = g.exec_memcpy_setter()
        dst = ph.data_ptr()
        rows["us_memcpy_setter"] = per_call(lambda a: setter(mnode, dst, a, 4096 * 4))
        # rebind every reading node to x2, disable the copy, poison the placeholder: replay = eager on x2
        for i in plan.nodes_of(0):
            n2, p2, a2 = params[i]
            _cuda.graph_exec_kernel_node_set_args(ex, n2, p2, plan.patch(i, [b for _, b in a2], {0: x2.data_ptr()}))
        err = drv.cuGraphNodeSetEnabled(ex, drv.CUgraphNode(_cuda.native(mnode)), 0)
        rows["set_enabled_err"] = int(err[0])
        ph.fill_(float("nan"))
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        want = (x2 * 2 + 1).sin() + x2
        rows["disabled_copy_rebound_equal"] = bool(torch.equal(y, want))
        rows["placeholder_untouched_nan"] = bool(torch.isnan(ph).all())
    g.close()
    return rows


def main(argv=None) -> int:
    import torch

    import cgraw
    from cgraw import _cuda

    ok, reason = _cuda.driver_available()
    if not ok:
        print(f"rebind_probe needs a CUDA GPU: {reason}", file=sys.stderr)
        return 2
    rows = []

    def t(*shape):
        return torch.randn(*shape, device="cuda")

    cases = [
        ("torch x*2+1 contiguous", lambda: (t(1 << 16), t(1 << 16)), lambda x: x * 2 + 1),
        ("torch sin of a transposed view", lambda: (t(256, 128), t(256, 128)), lambda x: torch.sin(x.t())),
        ("torch sum over rows", lambda: (t(512, 64), t(512, 64)), lambda x: x.sum(1)),
        ("torch matmul (cuBLAS)", lambda: (t(64, 64), t(64, 64)), lambda x: x @ x),
    ]
    try:
        import cupy as cp

        add1 = cp.ElementwiseKernel("float32 x", "float32 y", "y = x + 1", "cgraw_probe_add1")
        table_kernel = cp.RawKernel(r"""
        extern "C" __global__ void through_table(const float* const* table, float* out, int n) {
          int i = blockIdx.x * blockDim.x + threadIdx.x;
          if (i < n) out[i] = table[0][i] * 3.0f;
        }""", "through_table")

        tables = {}  # input address -> its one-entry pointer table, made before the capture

        def via_table(x):
            out = cp.empty_like(x)
            table_kernel((4,), (256,), (tables[x.data.ptr], out, cp.int32(x.size)))
            return out

        def crand():
            pair = (cp.random.standard_normal(1000, dtype=cp.float32),
                    cp.random.standard_normal(1000, dtype=cp.float32))
            for a in pair:
                tables[a.data.ptr] = cp.asarray([a.data.ptr], dtype=cp.uint64)
            return pair

        cases.append(("cupy ElementwiseKernel", crand, add1))
        cases.append(("cupy RawKernel through a pointer table", crand, via_table))
    except Exception as e:  # noqa: BLE001
        rows.append({"case": "cupy", "error": repr(e)})
    for name, make, body in cases:
        try:
            rows.append(_rebind_case(name, make, body, torch, cgraw))
        except Exception:  # noqa: BLE001 -- a probe: every case reports
            rows.append({"case": name, "error": traceback.format_exc()[-1500:]})
        print(json.dumps(rows[-1])[:400], flush=True)
    try:
        rows.append({"case": "timing", **_timing(torch, cgraw)})
    except Exception:  # noqa: BLE001
        rows.append({"case": "timing", "error": traceback.format_exc()[-1500:]})
    print(json.dumps(rows[-1])[:600], flush=True)
    out_dir = os.environ.get("OUT") or "."
    path = os.path.join(out_dir, "rebind_probe.json")
    with open(path, "w") as f:
        json.dump({"benchmark": "rebind_probe", "rows": rows}, f, indent=1)
    print("results:", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
