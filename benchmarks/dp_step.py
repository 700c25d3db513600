"""Data-parallel training step over NCCL, one process per GPU: graphed against eager.

Each rank runs, for ``steps`` steps, the same data-parallel step twice, on two identical copies of
its model: eagerly, and as one ``@cgraw.graphed`` function (forward, backward, an all-reduce of
every gradient, optimizer step). Reported per rank: the largest loss and parameter differences
between the two, the parameters of the graphed copy (so the caller can check that the ranks
agree), the tree's recordings and replays, and, when ``timed`` > 0, the host time per step with a
synchronise, graphed against eager.

Two variants:
- torch: a small MLP, ``torch.distributed`` with the NCCL backend, SGD with momentum;
- CuPy: linear regression on CuPy arrays with elementwise kernels and reductions (CuPy refuses
  cuBLAS during a capture), gradients all-reduced with ``cupy.cuda.nccl.NcclCommunicator``.

``python -m benchmarks.dp_step [--world-size N] [--steps S] [--timed T]`` runs it and writes
``benchmarks/results/dp_step_w{N}.json``. ``tests/gpu/test_multi_gpu.py`` runs it as a test.
NCCL's environment (``NCCL_NVLS_ENABLE`` and the rest) is left as the machine sets it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

FEATURES, HIDDEN, OUT, BATCH = 32, 64, 4, 16


def _batch(torch, rank: int, step: int):
    g = torch.Generator().manual_seed(100_003 * step + rank)
    x = torch.randn(BATCH, FEATURES, generator=g)
    y = torch.randn(BATCH, OUT, generator=g)
    return x.cuda(), y.cuda()


def _torch_variant(rank: int, world: int, steps: int, timed: int) -> dict:
    import torch
    import torch.distributed as dist

    import cgraw

    def make():
        torch.manual_seed(1234)  # the same initial parameters on every rank
        m = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(HIDDEN, OUT)).cuda()
        return m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    def step(model, opt, x, y):
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.div_(world)
        opt.step()
        return loss.detach()

    m_e, opt_e = make()
    m_g, opt_g = make()
    graphed = cgraw.graphed(lambda x, y: step(m_g, opt_g, x, y))
    loss_diff = 0.0
    losses = []
    for i in range(steps):
        x, y = _batch(torch, rank, i)
        le = step(m_e, opt_e, x, y)
        lg = graphed(x, y)
        loss_diff = max(loss_diff, float((lg - le).abs()))
        losses.append(float(lg))
    flat_g = torch.cat([p.detach().flatten() for p in m_g.parameters()])
    flat_e = torch.cat([p.detach().flatten() for p in m_e.parameters()])
    mgr = sys.modules["cgraw.trees.graphed"]._managers[rank]
    st = mgr.stats[graphed.fn_id]
    out = {
        "loss_max_abs_diff": loss_diff,
        "param_max_abs_diff": float((flat_g - flat_e).abs().max()),
        "params": flat_g.double().cpu().tolist(),
        "losses": losses,
        "recordings": st.recordings, "replays": st.replays, "warmups": st.warmups,
        "eager_calls": st.eager_calls, "skip_reasons": dict(st.skip_reasons),
    }
    if timed:
        x, y = _batch(torch, rank, 0)
        out["eager_us_per_step"] = _time_steps(torch, lambda: step(m_e, opt_e, x, y), timed)
        out["graphed_us_per_step"] = _time_steps(torch, lambda: graphed(x, y), timed)
    return out


def _time_steps(torch, fn, n: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / n * 1e6)
    samples.sort()
    return samples[len(samples) // 2]


def _cupy_variant(rank: int, world: int, steps: int, timed: int) -> dict:
    import cupy as cp
    import numpy as np
    import torch.distributed as dist

    import cgraw

    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        return {"unavailable": f"cupy.cuda.nccl: {exc}"}
    if not getattr(nccl, "available", True):
        return {"unavailable": "cupy.cuda.nccl is not available (no NCCL library found by CuPy)"}
    uid = [nccl.get_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(uid, src=0)
    comm = nccl.NcclCommunicator(world, uid[0], rank)
    w0 = np.random.default_rng(7).standard_normal(FEATURES).astype(np.float32)
    w_e, w_g = cp.asarray(w0), cp.asarray(w0)
    lr = np.float32(0.05)

    def step(w, x, y):
        err = (x * w).sum(axis=1) - y
        grad = (2.0 / x.shape[0]) * (err[:, None] * x).sum(axis=0)
        comm.allReduce(grad.data.ptr, grad.data.ptr, grad.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                       cp.cuda.get_current_stream().ptr)
        w -= (lr / world) * grad
        return (err * err).mean()

    graphed = cgraw.graphed(lambda x, y: step(w_g, x, y))
    loss_diff = 0.0
    for i in range(steps):
        rng = np.random.default_rng(100_003 * i + rank)
        x = cp.asarray(rng.standard_normal((BATCH * 4, FEATURES), dtype=np.float32))
        y = cp.asarray(rng.standard_normal(BATCH * 4, dtype=np.float32))
        le = step(w_e, x, y)
        lg = graphed(x, y)
        loss_diff = max(loss_diff, float(abs(lg - le)))
    mgr = sys.modules["cgraw.trees.graphed"]._managers[rank]
    st = mgr.stats[graphed.fn_id]
    out = {
        "loss_max_abs_diff": loss_diff,
        "param_max_abs_diff": float(abs(w_g - w_e).max()),
        "params": cp.asnumpy(w_g).astype(float).tolist(),
        "recordings": st.recordings, "replays": st.replays, "warmups": st.warmups,
        "eager_calls": st.eager_calls, "skip_reasons": dict(st.skip_reasons),
    }
    if timed:
        import torch

        out["eager_us_per_step"] = _time_steps(torch, lambda: step(w_e, x, y), timed)
        out["graphed_us_per_step"] = _time_steps(torch, lambda: graphed(x, y), timed)
    return out


def _worker(rank: int, world: int, store: str, out_dir: str, steps: int, timed: int) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    import cgraw

    cgraw.Device(rank).set_current()
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    try:
        result = {"rank": rank, "world_size": world, "device": torch.cuda.get_device_name(rank),
                  "torch": _torch_variant(rank, world, steps, timed)}
        cgraw.mark_step_begin()
        result["cupy"] = _cupy_variant(rank, world, steps, timed)
        cgraw.mark_step_begin()
        cgraw.reset()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def run_ranks(world: int, steps: int = 20, timed: int = 0, out_dir: str | None = None) -> list[dict]:
    """Run ``world`` ranks, one process and one GPU each; return their results, by rank."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out_dir = out_dir or tmp
        store = os.path.join(tmp, "store")
        mp.start_processes(_worker, args=(world, store, out_dir, steps, timed), nprocs=world,
                           join=True, start_method="spawn")
        results = []
        for r in range(world):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                results.append(json.load(f))
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.dp_step")
    ap.add_argument("--world-size", type=int, default=None, help="default: every GPU")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--timed", type=int, default=200, help="steps per timing sample")
    args = ap.parse_args(argv)
    import torch

    from benchmarks._harness import Report

    world = args.world_size or torch.cuda.device_count()
    rep = Report(f"dp_step_w{world}")
    results = run_ranks(world, args.steps, args.timed)
    for res in results:
        for variant in ("torch", "cupy"):
            v = res[variant]
            if "unavailable" in v:
                rep.peer_missing(f"{variant} rank {res['rank']}", v["unavailable"])
                continue
            rep.add(variant=variant, rank=res["rank"], world_size=world,
                    eager_us_per_step=v.get("eager_us_per_step"), graphed_us_per_step=v.get("graphed_us_per_step"),
                    speedup=(v["eager_us_per_step"] / v["graphed_us_per_step"]) if v.get("graphed_us_per_step") else None,
                    loss_max_abs_diff=v["loss_max_abs_diff"], param_max_abs_diff=v["param_max_abs_diff"],
                    recordings=v["recordings"], replays=v["replays"])
    print(f"results: {rep.save()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
