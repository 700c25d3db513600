"""A short end-to-end workload to run under ``compute-sanitizer --tool memcheck``: capture and
replay of torch, CuPy and mixed code, a graph tree with two branches, input copies, poisoning.

From the repository root:
``compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m tools.sanitize_smoke``
(``bash tools/gpu_session.sh smoke`` runs it so).
"""

from __future__ import annotations

import numpy as np


def main() -> int:
    import cupy as cp
    import torch

    import cgraw

    rng = np.random.default_rng()
    x = torch.randn(4096, device="cuda")
    w = torch.randn(256, 4096, device="cuda")
    with cgraw.capture() as g:
        y = torch.relu(w @ x) + 1.0
        c = cp.tanh(cp.from_dlpack(y)) * 2.0
        out = torch.from_dlpack(c).sum()
    for _ in range(5):
        x.copy_(torch.randn(4096, device="cuda"))
        g.replay()
        torch.testing.assert_close(out, (torch.tanh(torch.relu(w @ x) + 1.0) * 2.0).sum(), rtol=1e-4, atol=1e-3)
    g.close()

    a = cp.asarray(rng.standard_normal(10_000).astype(np.float32))
    with cgraw.capture() as gc_:
        b = cp.cumsum(cp.sin(a))
    gc_.replay()
    assert cp.allclose(b, cp.cumsum(cp.sin(a)))

    g1 = cgraw.graphed(lambda t: t * 2.0)
    g2 = cgraw.graphed(lambda t: torch.sin(t) + t)
    g3 = cgraw.graphed(lambda t: torch.cos(t) * t)
    for i in range(12):
        t = torch.randn(100_000, device="cuda")
        u = g1(t)
        v = g2(u) if i % 2 else g3(u)
        ref = torch.sin(t * 2.0) + t * 2.0 if i % 2 else torch.cos(t * 2.0) * (t * 2.0)
        torch.testing.assert_close(v, ref)
    torch.cuda.synchronize()
    cgraw.mark_step_begin()
    cgraw.reset()
    print("sanitize smoke: ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
