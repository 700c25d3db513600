"""The pieces of ``cgraw.while_loop`` and ``cgraw.cond`` on a GPU, one at a time, so that the
first failing one is named: the driver version and the node kinds cgraw picks for it; the
set-condition kernel compiled and loaded with ``-rdc=true`` and without; a torch loop counting to
ten in one WHILE node; both branches of an IF node; a loop nested in a branch; the node table.
Each step prints ``ok`` or its traceback and the probe goes on; the exit status is the number of
failed steps.

A diagnostic, not a test (``tests/gpu/test_control_flow.py`` is the test). From the repository
root: ``python3 -m tools.probes.conditional_probe``; needs a GPU and torch.
"""

from __future__ import annotations

import sys
import traceback


def _step(name: str, fn, failed: list) -> None:
    print(f"--- {name}", flush=True)
    try:
        out = fn()
        print(f"ok{': ' + str(out) if out is not None else ''}", flush=True)
    except Exception:  # noqa: BLE001 - a probe reports every failure and goes on
        traceback.print_exc()
        failed.append(name)


def main() -> int:
    import torch

    import cgraw
    from cgraw import _cuda
    from cgraw._cuda import kernels as _k
    from cgraw.control import kernels as K, plan

    failed: list[str] = []
    dev = torch.device("cuda", 0)

    def version():
        v = _cuda.driver_get_version()
        return f"driver {plan.version_text(v)}: while {plan.node_steps('while', v)}, cond {plan.node_steps('cond', v)}"

    def compile_with(options):
        def run():
            cgraw.Device(0).set_current()
            _k.function(0, K.SET_CONDITION, K.source, options)
            return f"options {options}"
        return run

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
        seen = []
        for sign in (1.0, -1.0):
            a.copy_(sign * torch.rand(64, device=dev))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, a + 1 if sign > 0 else a - 1)
            seen.append("true" if sign > 0 else "false")
        return f"branches {seen}"

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

    def table():
        n0 = torch.zeros((), dtype=torch.int64, device=dev)
        with cgraw.capture() as g:
            cgraw.while_loop(lambda n: n < 3, lambda n: (n + 1,), (n0,))
        print(g)
        return None

    _step("driver", version, failed)
    _step("set-condition kernel, -rdc=true", compile_with(K.options()), failed)
    _step("set-condition kernel, no extra options", compile_with(()), failed)
    _step("while: count to ten", count_to_ten, failed)
    _step("cond: both branches", both_branches, failed)
    _step("while nested in cond", nested, failed)
    _step("node table", table, failed)
    print(f"failed: {failed or 'none'}")
    return len(failed)


if __name__ == "__main__":
    sys.exit(main())
