"""The pieces of ``cgraw.while_loop`` and ``cgraw.cond`` on a GPU, one driver call per step, so that
the first failing call is named. Each step prints one line (``[NN] name: ok -- detail``,
``FAIL Type: message @ file:line`` or ``skip (needs NN)``); ``-v`` adds the traceback of a failure.
The exit status is the number of failed steps (``info`` steps never count).

A diagnostic, not a test (``tests/gpu/test_control_flow.py`` is the test). From the repository
root: ``python3 -m tools.probes.conditional_probe [-v]``; needs a GPU and torch (buffers only:
the driver-level steps launch cgraw's own NVRTC kernels, never a torch op inside a capture).
``python3 -m tools.probes.conditional_probe --compile-only 90`` runs the NVRTC steps without a GPU.

What each group settles, and what to do when it fails:

- ``nvrtc``: the set-condition kernel compiles with ``kernels.options()`` (no ``-rdc``) into an
  executable cubin (ELF type 2) that still references ``cudaGraphSetConditional`` (the driver
  resolves it at load, as it resolves ``vprintf``). ``load``: ``cuModuleLoadData`` of it; a
  failure here (``CUDA_ERROR_INVALID_IMAGE``, ``NOT_FOUND``) means this driver does not resolve the
  builtin in a module: link instead (``cuLinkCreate``, the cubin, ``libcudadevrt.a``). ``rdc`` (info):
  what the driver says of the ``-rdc=true`` image (relocatable: expected to be refused).
- ``W``: a WHILE node the way ``cgraw.control.nodes`` adds it, on one stream that pauses and
  resumes (Warp's ``capture_while``): handle, set kernel, ``cuGraphAddNode`` (``phGraph_out``
  filled by the binding), ``cuStreamUpdateCaptureDependencies``, pause, body, resume, instantiate,
  launch, a count to ten, and again from three. If ``W pause``/``W resume`` fail while ``X`` passes,
  the fallback is cuda.core's, PyTorch's and CuPy's: capture bodies on a second stream and never
  pause (``nodes._around_node``; cgraw's torch/CuPy routers then must follow that stream).
- ``X``: the same loop with the body on a second stream and the first never paused.
- ``I``: an IF node with two bodies (drivers from 12.8) on the pausing stream, each branch taken.
- ``cgraw``: the public functions inside ``cgraw.capture()``: a loop, both branches, a loop nested
  in a branch, the refusal of a loop after an unjoined fork, the node table.
"""

from __future__ import annotations

import sys
import traceback

PROBE_SRC = r"""
extern "C" __global__ void probe_step(unsigned long long* n, unsigned char* pred, unsigned long long limit,
                                      unsigned long long inc) {
  *n += inc;
  *pred = *n < limit ? 1 : 0;
}
extern "C" __global__ void probe_mark(unsigned long long* m, unsigned long long v) { *m = v; }
"""


class Probe:
    def __init__(self, verbose: bool):
        self.verbose, self.n, self.failed, self.done = verbose, 0, [], set()

    def step(self, key: str, name: str, fn, needs=(), info: bool = False):
        """Run ``fn()`` once as step ``key``; it is skipped if a step in ``needs`` did not pass."""
        self.n += 1
        head = f"[{self.n:02d}] {key} {name}:"
        missing = [k for k in needs if k not in self.done]
        if missing:
            print(f"{head} skip (needs {', '.join(missing)})", flush=True)
            return None
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - a probe reports every failure and goes on
            tb = traceback.extract_tb(e.__traceback__)
            where = f" @ {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
            msg = " ".join(str(e).split())[:300]
            print(f"{head} {'info' if info else 'FAIL'} {type(e).__name__}: {msg}{where}", flush=True)
            if self.verbose:
                traceback.print_exc()
            if not info:
                self.failed.append(key)
            return None
        self.done.add(key)
        print(f"{head} ok{' -- ' + str(out) if out is not None else ''}", flush=True)
        return out


def nvrtc_steps(p: Probe, arch: tuple[int, int]) -> dict:
    from cgraw._cuda import kernels as _k
    from cgraw.control import kernels as K

    st: dict = {}

    def compile_():
        img = _k.compile_image(K.source(K.SET_CONDITION), K.SET_CONDITION, arch, K.options())
        st["image"] = img
        elf = img[:4] == b"\x7fELF"
        etype = int.from_bytes(img[16:18], "little") if elf else None
        assert not elf or etype == 2, f"ELF type {etype}: not an executable image"
        assert b"cudaGraphSetConditional" in img and K.SET_CONDITION.encode() in img
        return f"{'cubin' if elf else 'PTX'} of {len(img)} bytes for sm_{arch[0]}{arch[1]}, options {K.options()}"

    def compile_rdc():
        img = _k.compile_image(K.source(K.SET_CONDITION), K.SET_CONDITION, arch, ("-rdc=true",))
        st["rdc_image"] = img
        return f"ELF type {int.from_bytes(img[16:18], 'little')} (1: relocatable)"

    p.step("nvrtc", "set-condition kernel compiles (no -rdc)", compile_)
    p.step("nvrtc-rdc", "the same with -rdc=true", compile_rdc, info=True)
    return st


def driver_steps(p: Probe, st: dict) -> None:
    import torch
    from cuda.bindings import driver as drv

    import cgraw
    from cgraw import _cuda
    from cgraw._cuda import conditional as _cond, kernels as _k
    from cgraw.control import kernels as K, plan

    dev = cgraw.Device(0)
    dev.set_current()
    mode = _cuda.CAPTURE_MODES["thread_local"]
    n = torch.zeros((), dtype=torch.int64, device="cuda")
    m = torch.zeros((), dtype=torch.int64, device="cuda")
    pred = torch.zeros((), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    P, U = _k.ARG_PTR, _k.ARG_U64

    def version():
        v = _cuda.driver_get_version()
        st["version"] = v
        return f"driver {plan.version_text(v)}: while {plan.node_steps('while', v)}, cond {plan.node_steps('cond', v)}"

    def load():
        st["set"] = _k.function(0, K.SET_CONDITION, K.source, K.options())
        st["step"] = _k.function(0, "probe_step", lambda name: PROBE_SRC, ())
        st["mark"] = _k.function(0, "probe_mark", lambda name: PROBE_SRC, ())
        return "cuModuleLoadData + cuModuleGetFunction of the set-condition kernel and the probe's kernels"

    def load_rdc():
        _cuda.check(drv.cuModuleLoadData(st["rdc_image"]), "cuModuleLoadData")
        return "the driver loaded the relocatable image"

    p.step("driver", "version and node kinds", version)
    p.step("load", "load the set-condition kernel", load, needs=("nvrtc",))
    p.step("load-rdc", "load the -rdc=true image", load_rdc, needs=("nvrtc-rdc",), info=True)

    def set_cond(h, s, negate=0):
        _k.launch(st["set"], 1, 1, (_cond.conditional_handle_value(h), pred.data_ptr(), negate), (U, P, U), s)

    def step_kernel(s, inc):
        _k.launch(st["step"], 1, 1, (n.data_ptr(), pred.data_ptr(), 10, inc), (P, P, U, U), s)

    def mark(s, v):
        _k.launch(st["mark"], 1, 1, (m.data_ptr(), v), (P, U), s)

    def run_graph(g, n0=0):
        n.fill_(n0)
        m.zero_()
        torch.cuda.synchronize()
        s = _cuda.stream_create()
        _cuda.check(_cuda.graph_launch_raw(g["exec"], s), "cuGraphLaunch")
        _cuda.stream_synchronize(s)
        return int(n), int(m)

    def loop(tag: str, side: bool):
        """Steps of one WHILE node; ``side``: the body on a second stream, the first never paused."""
        g: dict = {}

        def begin():
            g["s"] = _cuda.stream_create()
            _cuda.stream_begin_capture(g["s"], mode)
            g["graph"], deps = _cuda.stream_capture_graph(g["s"])
            return f"{len(deps)} capture dependencies"

        def handle():
            g["h"] = _cond.graph_conditional_handle_create(g["graph"], dev.context, 0, 0)
            return f"handle value {_cond.conditional_handle_value(g['h'])}"

        def initial():
            step_kernel(g["s"], 0)
            set_cond(g["h"], g["s"])
            _, deps = _cuda.stream_capture_graph(g["s"])
            assert len(deps) == 1, deps
            g["deps"] = deps
            return "probe_step + set-condition kernel captured; 1 dependency"

        def add():
            g["node"], bodies = _cond.graph_add_conditional_node(g["graph"], g["deps"], g["h"], "while", 1, dev.context)
            assert len(bodies) == 1 and _cuda.native(bodies[0]) != 0, bodies
            g["body"] = bodies[0]
            return f"cuGraphAddNode; phGraph_out[0] = 0x{_cuda.native(bodies[0]):x}"

        def update():
            _cond.stream_set_capture_dependencies(g["s"], [g["node"]])
            _, deps = _cuda.stream_capture_graph(g["s"])
            assert [_cuda.native(d) for d in deps] == [_cuda.native(g["node"])], deps
            return "the stream's capture dependencies are [node]"

        def pause():
            got = _cond.stream_end_capture_into(g["s"])
            assert _cuda.native(got) == _cuda.native(g["graph"])
            return "cuStreamEndCapture returned the graph being captured"

        def body():
            s = _cuda.stream_create() if side else g["s"]
            _cond.stream_begin_capture_to_graph(s, g["body"], [], mode)
            step_kernel(s, 1)
            set_cond(g["h"], s)
            _cond.stream_end_capture_into(s)
            types = [_cuda.NodeType(int(_cuda.graph_node_get_type(x))).name for x in _cuda.graph_get_nodes(g["body"])]
            return f"body on the {'second' if side else 'same'} stream: {types}"

        def resume():
            _cond.stream_begin_capture_to_graph(g["s"], g["graph"], [g["node"]], mode)
            return "cuStreamBeginCaptureToGraph(S, G, [node])"

        def finish():
            mark(g["s"], 7)
            err, graph = _cuda.stream_end_capture_raw(g["s"])
            if err:
                raise _cuda.make_error(err, "cuStreamEndCapture")
            g["exec"] = _cuda.graph_instantiate(graph)
            types = [_cuda.NodeType(int(_cuda.graph_node_get_type(x))).name for x in _cuda.graph_get_nodes(graph)]
            return f"cuStreamEndCapture + cuGraphInstantiateWithParams; {types}"

        def launch():
            got = run_graph(g)
            assert got == (10, 7), got
            again = run_graph(g, 3)
            assert again == (10, 7), again
            return "counted to 10 from 0 and from 3; the node after the loop ran"

        p.step(f"{tag}1", "begin capture, capture info", begin, needs=("load",))
        p.step(f"{tag}2", "cuGraphConditionalHandleCreate", handle, needs=(f"{tag}1",))
        p.step(f"{tag}3", "initial value: set-condition kernel", initial, needs=(f"{tag}2",))
        p.step(f"{tag}4", "cuGraphAddNode(WHILE)", add, needs=(f"{tag}3",))
        p.step(f"{tag}5", "cuStreamUpdateCaptureDependencies", update, needs=(f"{tag}4",))
        if not side:
            p.step(f"{tag}6", "pause: cuStreamEndCapture", pause, needs=(f"{tag}5",))
        p.step(f"{tag}7", "body: cuStreamBeginCaptureToGraph ... cuStreamEndCapture", body,
               needs=(f"{tag}5",) if side else (f"{tag}6",))
        if not side:
            p.step(f"{tag}8", "resume: cuStreamBeginCaptureToGraph", resume, needs=(f"{tag}7",))
        p.step(f"{tag}9", "end the capture, instantiate", finish, needs=(f"{tag}7",) if side else (f"{tag}8",))
        p.step(f"{tag}10", "launch", launch, needs=(f"{tag}9",))

    loop("W", side=False)
    loop("X", side=True)

    def if_else():
        if st.get("version", 0) < plan.IF_ELSE_NODES:
            return "driver before 12.8: no IF node with two bodies (cgraw uses two IF nodes)"
        s = _cuda.stream_create()
        _cuda.stream_begin_capture(s, mode)
        graph, _ = _cuda.stream_capture_graph(s)
        h = _cond.graph_conditional_handle_create(graph, dev.context, 0, 0)
        step_kernel(s, 0)  # pred = n < 10
        set_cond(h, s)
        _, deps = _cuda.stream_capture_graph(s)
        node, bodies = _cond.graph_add_conditional_node(graph, deps, h, "if", 2, dev.context)
        _cond.stream_set_capture_dependencies(s, [node])
        _cond.stream_end_capture_into(s)
        for body, v in zip(bodies, (1, 2)):
            _cond.stream_begin_capture_to_graph(s, body, [], mode)
            mark(s, v)
            _cond.stream_end_capture_into(s)
        _cond.stream_begin_capture_to_graph(s, graph, [node], mode)
        err, graph = _cuda.stream_end_capture_raw(s)
        if err:
            raise _cuda.make_error(err, "cuStreamEndCapture")
        g = {"exec": _cuda.graph_instantiate(graph)}
        taken = (run_graph(g, 0)[1], run_graph(g, 20)[1])
        assert taken == (1, 2), taken
        return "n < 10 took the first body, n >= 10 the second"

    p.step("I", "IF node with two bodies, pausing stream", if_else, needs=("load", "driver"))


def cgraw_steps(p: Probe) -> None:
    import torch

    import cgraw

    dev = torch.device("cuda", 0)

    def count_to_ten():
        n0 = torch.zeros((), dtype=torch.int64, device=dev)
        with cgraw.capture() as g:
            (n,) = cgraw.while_loop(lambda n: n < 10, lambda n: (n + 1,), (n0,))
        g.replay()
        torch.cuda.synchronize()
        assert int(n) == 10, int(n)
        return f"n = {int(n)}; {g.num_nodes} top-level nodes"

    def both_branches():
        a = torch.randn(64, device=dev)
        with cgraw.capture() as g:
            y = cgraw.cond(a.sum() > 0, lambda v: v + 1, lambda v: v - 1, (a,))
        for sign in (1.0, -1.0):
            a.copy_(sign * torch.rand(64, device=dev))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, a + 1 if sign > 0 else a - 1)
        return "true and false branches"

    def nested():
        a = torch.randn(32, device=dev) * 100
        n0 = torch.zeros((), dtype=torch.int64, device=dev)

        def halve(x):
            return cgraw.while_loop(lambda v, n: v.abs().max() > 1, lambda v, n: (v * 0.5, n + 1), (x, n0))

        with cgraw.capture() as g:
            v, n = cgraw.cond(a[0] > 0, halve, lambda x: (x.clone(), n0.clone()), (a,))
        g.replay()
        torch.cuda.synchronize()
        ev, en = cgraw.cond(a[0] > 0, halve, lambda x: (x.clone(), n0.clone()), (a,))
        assert torch.equal(v, ev) and int(n) == int(en)
        return f"n = {int(n)}"

    def unjoined():
        x = torch.randn(8, device=dev)
        side = torch.cuda.Stream()  # made outside the capture
        try:
            with cgraw.capture():
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    x * 2
                cgraw.while_loop(lambda v: v.sum() < 0, lambda v: (v,), (x,))
        except cgraw.CaptureError as e:
            chain = []
            while e is not None:
                chain.append(getattr(e, "name", type(e).__name__))
                e = e.__cause__ or e.__context__
            assert "CONDITIONAL_AFTER_UNJOINED_FORK" in chain, chain
            return f"refused: {chain}"
        raise AssertionError("the loop after an unjoined fork was captured")

    def table():
        n0 = torch.zeros((), dtype=torch.int64, device=dev)
        with cgraw.capture() as g:
            cgraw.while_loop(lambda n: n < 3, lambda n: (n + 1,), (n0,))
        assert "CONDITIONAL" in str(g)
        return " | ".join(str(g).splitlines()[:6])

    p.step("cgraw1", "while_loop: count to ten", count_to_ten, needs=("load",))
    p.step("cgraw2", "cond: both branches", both_branches, needs=("load",))
    p.step("cgraw3", "while_loop nested in cond", nested, needs=("load",))
    p.step("cgraw4", "a loop after an unjoined fork is refused", unjoined, needs=("load",))
    p.step("cgraw5", "node table", table, needs=("load",))


def main(argv: list[str]) -> int:
    p = Probe(verbose="-v" in argv)
    if "--compile-only" in argv:
        cc = argv[argv.index("--compile-only") + 1]
        nvrtc_steps(p, (int(cc[:-1]), int(cc[-1])))
    else:
        import cgraw
        from cgraw import _cuda
        from cgraw._cuda import kernels as _k

        _cuda.init()
        cgraw.Device(0).set_current()
        arch = _k.compute_capability(0)
        st = nvrtc_steps(p, arch)
        driver_steps(p, st)
        cgraw_steps(p)
    print(f"failed: {p.failed or 'none'}", flush=True)
    return len(p.failed)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
