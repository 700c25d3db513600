"""``python -m benchmarks``'s part selection (CPU: no part runs)."""

import argparse

import pytest

from benchmarks.__main__ import PARTS, _parts


def test_only_takes_a_comma_separated_list_of_known_parts():
    assert _parts("models") == {"models"}
    assert _parts("models, graphed,profile") == {"models", "graphed", "profile"}
    assert _parts(",".join(PARTS)) == set(PARTS)


@pytest.mark.parametrize("text", ["modles", "models,nope", ",", ""])
def test_only_rejects_unknown_or_empty_selections(text):
    with pytest.raises(argparse.ArgumentTypeError):
        _parts(text)


def test_rebind_is_a_registered_part_and_runs_last():
    assert PARTS["rebind"] == ("benchmarks.rebind", [])
    assert list(PARTS)[-1] == "rebind"  # a sticky CUDA error there cannot fail the other parts
    assert _parts("cupy_coverage,rebind") == {"cupy_coverage", "rebind"}


def test_rebind_help_needs_no_gpu(capsys):
    from benchmarks import rebind

    with pytest.raises(SystemExit) as exc:
        rebind.main(["--help"])
    assert exc.value.code == 0
    assert "--quick" in capsys.readouterr().out


def test_rebind_without_a_gpu_exits_2_with_the_reason(monkeypatch, capsys):
    from benchmarks import rebind
    from benchmarks.__main__ import main
    from cgraw import _cuda

    monkeypatch.setattr(_cuda, "driver_available", lambda: (False, "no driver (test)"))
    assert rebind.main(["--quick"]) == 2
    assert "benchmarks need a CUDA GPU: no driver (test)" in capsys.readouterr().err
    assert main(["--only", "rebind"]) == 2
    assert "no driver (test)" in capsys.readouterr().err


def test_cupy_loops_is_a_part_and_needs_a_gpu(monkeypatch, capsys):
    from benchmarks import cupy_loops
    from cgraw import _cuda

    assert PARTS["cupy_loops"] == ("benchmarks.cupy_loops", [])
    with pytest.raises(SystemExit) as exc:
        cupy_loops.main(["--help"])
    assert exc.value.code == 0 and "--quick" in capsys.readouterr().out
    monkeypatch.setattr(_cuda, "driver_available", lambda: (False, "no driver (test)"))
    assert cupy_loops.main(["--quick"]) == 2
    assert "no driver (test)" in capsys.readouterr().err
