"""CPU tier: ``benchmarks/`` holds what users run, ``tools/`` the probes, diagnostics, the sanitizer
smoke run and the GPU machine's session script; ``benchmarks/results/`` one current JSON per
benchmark. The tools run from the repository root as modules (``python3 -m tools.probes.NAME``)."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMPORTABLE = ("tools.call_walk", "tools.probes.pool_probe", "tools.probes.conditional_probe", "tools.probes.rebind_probe", "tools.probes.rebind_resnet_probe",
              "tools.probes.train_step_probe", "tools.probes.whole_graph_probe", "tools.probes.compile_probe", "tools.probes.cublas_workspace_probe", "tools.probes.host_mode_probe", "tools.sanitize_smoke", "tools.diag.pytest_diag")  # rng_probe runs its checks on import


def test_benchmarks_holds_no_probes_diagnostics_or_session_script():
    bench = ROOT / "benchmarks"
    assert not sorted(bench.glob("*_probe.py"))
    assert not (bench / "diag").exists()
    assert not (bench / "sanitize_smoke.py").exists() and not (bench / "gpu_session.sh").exists()
    for name in ("pool_probe", "rebind_probe", "rebind_resnet_probe", "rng_probe"):
        assert (ROOT / "tools" / "probes" / f"{name}.py").is_file(), name
    assert (ROOT / "tools" / "diag" / "segv_handler.c").is_file()


def test_results_keep_no_archived_runs():
    names = [p.name for p in (ROOT / "benchmarks" / "results").iterdir()]
    archived = [n for n in names if re.search(r"_run\d*(_|\.)|_[0-9a-f]{7}\.json$|probe|\d{4}-\d\d-\d\d", n)]
    assert not archived, archived


@pytest.mark.parametrize("module", IMPORTABLE)
def test_tools_import_from_the_repository_root(module):
    """Importing runs nothing: each tool needs a device only in its ``main``."""
    mod = importlib.import_module(module)
    assert mod.__doc__ and "tools" in mod.__doc__, module


@pytest.mark.parametrize("probe", ["pool_probe", "train_step_probe", "whole_graph_probe", "cublas_workspace_probe",
                                   "host_mode_probe"])
def test_probes_parse_their_command_lines_without_a_device(probe):
    out = subprocess.run([sys.executable, "-m", f"tools.probes.{probe}", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"python3 -m tools.probes.{probe}" in out.stdout


def test_the_session_script_names_modules_and_files_that_exist():
    text = (ROOT / "tools" / "gpu_session.sh").read_text()
    for module in set(re.findall(r"python3? -m ([A-Za-z_][\w.]*)", text) + re.findall(r"-p (tools\.[\w.]+)", text)):
        if module == "pytest":
            continue
        parts = module.split(".")
        assert ((ROOT.joinpath(*parts).with_suffix(".py")).is_file()
                or (ROOT.joinpath(*parts) / "__main__.py").is_file()), module
    for path in set(re.findall(r"\b((?:benchmarks|tools|tests)/[\w./*]+)", text)):
        path = path.rstrip("/.")
        if "*" in path:  # a glob names at least one file
            assert list(ROOT.glob(path)), path
        else:
            assert (ROOT / path).exists(), path
