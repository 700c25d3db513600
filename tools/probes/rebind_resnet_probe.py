"""``python3 -m tools.probes.rebind_resnet_probe`` (from the repository root; it imports
``benchmarks._harness``): why does a ResNet-18 training step keep its input copies?

A probe, not a benchmark. A whole torchvision ResNet-18 training step (forward, cross-entropy,
backward, SGD with momentum; batch 8 at 224 px, TF32 off) can keep both eager inputs' copies
because the proof's two runs differ (``benchmarks.memory``'s ``resnet_train``). If cuDNN's
non-deterministic backward kernels are the cause, the same step with
``torch.backends.cudnn.deterministic = True`` (and ``benchmark = False``) should read its inputs in
place. Each setting runs in a fresh tree (``cgraw.reset()``), three steps (warm-up, recording with
its proof, one replay), and the report's lines for the node are kept. Writes
``rebind_resnet_probe.json`` to ``$OUT`` (or the current directory).
"""

from __future__ import annotations

import io
import json
import os
import sys


def main(argv=None) -> int:
    import torch
    import torchvision

    import cgraw
    from benchmarks._harness import environment

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for deterministic in (False, True):
        torch.backends.cudnn.deterministic = deterministic
        torch.backends.cudnn.benchmark = False
        torch.manual_seed(0)
        model = torchvision.models.resnet18(weights=None).cuda().train()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step(x, y):
            opt.zero_grad(set_to_none=False)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss.detach()

        cgraw.reset()
        f = cgraw.graphed(step)
        for _ in range(3):
            cgraw.mark_step_begin()
            x = torch.randn(8, 3, 224, 224, device="cuda")
            y = torch.randint(0, 1000, (8,), device="cuda")
            f(x, y)
        torch.cuda.synchronize()
        text = cgraw.report(file=io.StringIO())
        lines = [ln.strip() for ln in text.splitlines() if "rebound" in ln or "copied:" in ln]
        rows.append({"cudnn_deterministic": deterministic, "report_lines": lines})
        print(json.dumps(rows[-1]), flush=True)
    out_dir = os.environ.get("OUT") or "."
    path = os.path.join(out_dir, "rebind_resnet_probe.json")
    with open(path, "w") as fh:
        json.dump({"benchmark": "rebind_resnet_probe", "environment": environment(), "rows": rows}, fh, indent=1)
    print("results:", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
