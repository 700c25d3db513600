"""CPU tier: the abort-diagnosis tools of ``tools/diag`` (``tools/gpu_session.sh segv``) print what
they must: pytest captures file descriptor 2 during a test, so the native backtrace must go to its
own file, and it must still reach Python's faulthandler after."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tools.diag import pytest_diag

ROOT = Path(__file__).resolve().parents[2]


def test_falling_reference_counts_are_found_and_steady_ones_are_not():
    series = {
        1: (int, "steady", [5, 5, 6, 5, 5, 6, 5]),
        2: (dict, "leaking down", [40, 39, 38, 37, 36, 35, 34]),
        3: (list, "noisy but flat", [9, 8, 9, 8, 9, 8, 9]),
        4: (str, "too short", [9, 8, 7]),
        5: (tuple, "died midway", [9, 8, None, 6, 5, 4, 3]),
    }
    rows = pytest_diag.falling(series)
    assert [r[4] for r in rows] == ["leaking down"]
    assert rows[0][:3] == (-6, 6, 0)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="building the native handler needs gcc")
def test_a_segfault_in_a_test_leaves_the_test_name_and_a_native_backtrace(tmp_path):
    so = tmp_path / "segv_handler.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(so), str(ROOT / "tools/diag/segv_handler.c"),
                    "-ldl"], check=True)
    (tmp_path / "test_crash.py").write_text(textwrap.dedent("""
        import ctypes, sys

        def test_fine():
            pass

        def test_crashes():
            print("captured by pytest", file=sys.stderr)
            ctypes.string_at(16)  # reads address 16: SIGSEGV
    """))
    env = dict(os.environ, PYTHONPATH=str(ROOT), CGRAW_DIAG_SEGV=str(so),
               CGRAW_DIAG_NATIVE_OUT=str(tmp_path / "native.txt"), CGRAW_DIAG_LOG=str(tmp_path / "tests.txt"))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                        "tools.diag.pytest_diag", str(tmp_path / "test_crash.py")],
                       env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode != 0
    log = (tmp_path / "tests.txt").read_text().splitlines()
    assert log[-1] == "START test_crash.py::test_crashes" and any(s.startswith("END test_crash.py::test_fine")
                                                                    for s in log)
    native = (tmp_path / "native.txt").read_text()
    assert "=== native signal 11" in native and "=== end native ===" in native
    assert "_ctypes" in native or "ffi_call" in native  # the frames of the faulting call
    assert "Fatal Python error: Segmentation fault" in r.stderr + r.stdout  # faulthandler still ran after


def test_autograd_switch_turns_autograd_on_before_every_test(tmp_path):
    (tmp_path / "test_on.py").write_text(textwrap.dedent("""
        import cgraw

        def test_first():
            assert cgraw.config.autograd is True
            cgraw.config.autograd = False  # a test that turns it off and does not restore it

        def test_second():
            assert cgraw.config.autograd is True
    """))
    env = dict(os.environ, PYTHONPATH=str(ROOT), CGRAW_DIAG_AUTOGRAD="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                        "tools.diag.pytest_diag", str(tmp_path / "test_on.py")],
                       env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    env["CGRAW_DIAG_AUTOGRAD"] = "0"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                        "tools.diag.pytest_diag", str(tmp_path / "test_on.py")],
                       env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode != 0  # off unless asked
