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


def test_training_is_a_part_and_needs_a_gpu(monkeypatch, capsys):
    from benchmarks import training
    from cgraw import _cuda

    assert PARTS["training"] == ("benchmarks.training", [])
    assert list(PARTS).index("training") < list(PARTS).index("rebind")
    with pytest.raises(SystemExit) as exc:
        training.main(["--help"])
    assert exc.value.code == 0 and "--quick" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        training.main(["--systems", "eager,nope"])
    monkeypatch.setattr(_cuda, "driver_available", lambda: (False, "no driver (test)"))
    assert training.main(["--quick"]) == 2
    assert "no driver (test)" in capsys.readouterr().err


def test_training_rows_are_valid_only_when_forward_and_backward_replayed():
    from benchmarks.training import _goals, _invalid

    def st(replays, eager=0, rerecords=0, skips=None):
        return {"warmups": 1, "recordings": 1, "rerecords": rerecords, "replays": replays, "eager_calls": eager,
                "skip_reasons": skips or {}, "rerecord_reasons": []}

    before = {"forward": st(3), "backward": st(2)}
    assert _invalid(before, {"forward": st(13), "backward": st(12)}, 10, backward=True) == []
    assert _invalid(before, {"forward": st(13), "backward": None}, 10, backward=False) == []
    assert "no backward" in _invalid(before, {"forward": st(13), "backward": None}, 10, backward=True)[0]
    why = _invalid(before, {"forward": st(13), "backward": st(2, eager=10)}, 10, backward=True)
    assert any("0 replays for 10" in w for w in why) and any("10 eager call(s)" in w for w in why)
    why = _invalid(before, {"forward": st(13, skips={"recomputed": 1}), "backward": st(12)}, 10, backward=True)
    assert why and "recomputed" in why[0]

    res = {"cgraw_forward": {"step": [110.0] * 9}, "cgraw_whole_step": {"step": [100.0] * 9},
           "reduce_overhead": {"step": [200.0] * 9}}
    rows = {s: {"valid": True} for s in res}
    goals = _goals(rows, res)
    assert goals["cgraw_forward_over_cgraw_whole_step"]["verdict"] == "met"
    assert goals["cgraw_forward_over_reduce_overhead"]["verdict"] == "met"
    rows["cgraw_forward"] = {"valid": False, "invalid_reason": "backward: 0 replays"}
    assert _goals(rows, res)["cgraw_forward_over_cgraw_whole_step"]["verdict"].startswith("not valid")
    del res["reduce_overhead"]
    assert _goals(rows, res)["cgraw_forward_over_reduce_overhead"]["verdict"].startswith("not measured")


def test_training_check_holds_graphs_elementwise_and_the_compiled_peer_in_norm():
    """The check compares what each step changed with eager's change: elementwise for graph
    systems, in L2 norm for reduce_overhead (Inductor reorders reductions); a step that did
    nothing fails both."""
    torch = pytest.importorskip("torch")
    from benchmarks.training import CheckFailed, _check

    model = torch.nn.Linear(1000, 1, bias=False)
    init = [t.detach().clone() for t in model.parameters()]
    change = torch.full((1, 1000), 1e-3)
    outlier = change.clone()
    outlier[0, 7] *= 3.0  # one element off by 200%, the whole change off by 6% in norm
    ref = [(1.0, [init[0] + change])]

    def stepper(delta):
        def step(batch):
            with torch.no_grad():
                model.weight.copy_(init[0] + delta)
            return torch.tensor(1.0)
        return step

    info = {"model": model}
    assert _check(torch, None, stepper(change), info, [None], ref, init, compiled=False) == 0.0
    with pytest.raises(CheckFailed, match="weight"):
        _check(torch, None, stepper(outlier), info, [None], ref, init, compiled=False)
    _check(torch, None, stepper(outlier), info, [None], ref, init, compiled=True)
    for compiled in (False, True):
        with pytest.raises(CheckFailed, match="weight"):
            _check(torch, None, stepper(torch.zeros(1, 1000)), info, [None], ref, init, compiled=compiled)


def test_threads_is_a_part_and_needs_a_gpu(monkeypatch, capsys):
    from benchmarks import threads
    from cgraw import _cuda

    assert PARTS["threads"] == ("benchmarks.threads", [])
    assert list(PARTS).index("threads") < list(PARTS).index("rebind")
    with pytest.raises(SystemExit) as exc:
        threads.main(["--help"])
    assert exc.value.code == 0 and "--threads" in capsys.readouterr().out
    for bad in (["--threads", "1,x"], ["--threads", "0"], ["--systems", "eager,nope"]):
        with pytest.raises(SystemExit):
            threads.main(bad)
    monkeypatch.setattr(_cuda, "driver_available", lambda: (False, "no driver (test)"))
    assert threads.main(["--threads", "2"]) == 2
    assert "no driver (test)" in capsys.readouterr().err


def test_threads_summary_takes_medians_and_per_round_ratios_to_eager():
    from benchmarks.threads import summarise

    def row(system, n, r, cps, used=1.0):
        return {"system": system, "threads": n, "round": r, "calls_per_s": cps, "us_per_call_per_thread": 1e6 / cps,
                "used_mib": used, "torch_reserved_mib": used, "torch_allocated_mib": used}

    rows = [row("eager", 2, 0, 100.0), row("graphed", 2, 0, 300.0, 4.0), row("eager", 2, 1, 200.0),
            row("graphed", 2, 1, 400.0, 6.0), row("graphed", 2, 2, 999.0),  # no eager in round 2: no ratio
            {"system": "one_tree", "threads": 2, "round": 0, "error": "thread 0: AssertionError"}]
    s = summarise(rows)
    assert s["graphed x2"]["calls_per_s_vs_eager"] == 2.5  # median of 3.0 and 2.0
    assert s["graphed x2"]["calls_per_s"] == 400.0 and s["graphed x2"]["used_mib"] == 4.0
    assert s["graphed x2"]["runs"] == 3 and s["eager x2"]["calls_per_s_vs_eager"] == 1.0
    assert "one_tree x2" not in s  # a failed check is never summarised
