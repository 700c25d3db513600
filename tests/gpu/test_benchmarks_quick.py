"""The README's main command, ``python3 -m benchmarks`` (the quick run), end to end on the GPU: it
finishes within a few minutes, exits 0, writes its parts' JSON and prints the summary table.

Slow tier (about 2-3 minutes); alone: ``python3 -m pytest -m gpu tests/gpu/test_benchmarks_quick.py``.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

REPO = pathlib.Path(__file__).resolve().parents[2]
LIMIT_S = 420  # "a few minutes" on one H200; the estimate is about 2-3


@pytest.mark.timeout(LIMIT_S + 60)  # pytest-timeout's limit, where it is installed, above the run's own
def test_the_quick_run_finishes_and_prints_its_summary(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")  # the models part's GPT-2
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CGRAW_RUN_ID", None)  # a run id of its own
    try:
        done = subprocess.run([sys.executable, "-m", "benchmarks", "--out-dir", str(tmp_path)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=LIMIT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        tail = exc.stdout or ""
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        pytest.fail(f"the quick run took more than {LIMIT_S} s; its output ended with:\n{tail[-3000:]}")
    out = done.stdout
    assert done.returncode == 0, f"status {done.returncode}\n{out[-4000:]}\n{done.stderr[-4000:]}"
    for part in ("launch", "graphed", "models"):
        assert f"[benchmarks] part {part}: " in out
    summary = out[out.index("[benchmarks] summary of run "):]
    lines = summary.splitlines()
    assert lines[1].split() == ["part", "measure", "cgraw", "peer", "peer's", "cgraw/peer"]
    run_id = lines[0].split()[4]
    for name in ("launch_overhead_quick.json", "graphed_call_quick.json", "models_quick.json"):
        doc = json.loads((tmp_path / name).read_text())
        assert doc["run_id"] == run_id
        assert not doc["failed_checks"], doc["failed_checks"]
    table = lines[2:]
    assert not [ln for ln in table if "no result" in ln], summary
    # the figures every user looks at were measured: cgraw's replay, its graphed call against the
    # hand-made graph and the driver's floor, GPT-2 against eager
    for part, peer in (("launch", "raw cuGraphLaunch"), ("graphed", "torch.cuda.CUDAGraph + copy_"),
                       ("graphed", "driver floor"), ("models", "eager torch")):
        row = next(ln for ln in table if ln.startswith(part) and peer in ln)
        assert row.split()[-1] != "-", row
