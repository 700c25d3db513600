"""``python -m benchmarks``: the quick run's plan and summary, part selection, and every part's
command line (CPU: no part runs)."""

import argparse
import importlib
import json
import os
import pathlib
import subprocess
import sys
import types

import pytest

from benchmarks.__main__ import PARTS, QUICK, _parse, _parts, plan

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def no_driver(monkeypatch):
    from cgraw import _cuda

    monkeypatch.setattr(_cuda, "driver_available", lambda: (False, "no driver (test)"))


@pytest.fixture
def driver_untouched(monkeypatch):
    """Parsing a command line must not ask for the driver."""
    from cgraw import _cuda

    def called():
        raise AssertionError("the driver was probed while parsing a command line")

    monkeypatch.setattr(_cuda, "driver_available", called)


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


# ---------------------------------------------------------------- the main command's plan


def test_the_main_command_is_the_quick_run_of_launch_graphed_and_models(tmp_path):
    steps = plan(_parse(["--out-dir", str(tmp_path)]))
    assert [p for p, *_ in steps] == ["launch", "graphed", "models"] == list(QUICK)
    for part, module, args, path in steps:
        assert module == PARTS[part][0]
        assert "--quick" in args
        assert args[args.index("--out") + 1] == path == str(tmp_path / os.path.basename(path))
        assert path.endswith("_quick.json")
    models_args = steps[2][2]
    assert models_args[models_args.index("--only") + 1] == "gpt2_b1"


def test_full_runs_every_part_in_order_and_only_picks_parts_of_it():
    steps = plan(_parse(["--full"]))
    assert [p for p, *_ in steps] == list(PARTS)
    assert all("--quick" not in args and "--out" not in args for _, _, args, _ in steps)
    only = plan(_parse(["--only", "rebind,launch"]))
    assert [p for p, *_ in only] == ["launch", "rebind"]  # the full run's order, full form
    assert only[0][2] == [] and only[0][3].endswith("launch_overhead.json") and only[1][3] is None


def test_sizes_go_to_the_launch_part_only():
    for argv in ([], ["--full"]):
        steps = plan(_parse([*argv, "--sizes", "1,16"]))
        for part, _, args, _ in steps:
            assert (args[-2:] == ["--sizes", "1,16"]) == (part == "launch")


def test_out_dir_is_refused_for_the_full_run(capsys):
    for argv in (["--full", "--out-dir", "x"], ["--only", "models", "--out-dir", "x"]):
        with pytest.raises(SystemExit) as exc:
            _parse(argv)
        assert exc.value.code == 2
    assert "--out-dir applies to the quick run" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["--full"], ["--only", "graphed"]])
def test_without_a_gpu_every_form_exits_2_with_one_line(no_driver, capsys, argv):
    from benchmarks.__main__ import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == "benchmarks need a CUDA GPU: no driver (test)\n"


# ---------------------------------------------------------------- every part's command line


def _part_commands():
    """(part, arguments) of every command line ``python -m benchmarks`` hands a part."""
    out = [(part, args) for part, _, args, _ in plan(_parse(["--full", "--sizes", "1,16"]))]
    out += [(part, args) for part, _, args, _ in plan(_parse(["--out-dir", "/nonexistent/dir", "--sizes", "2"]))]
    return out


@pytest.mark.parametrize("part,args", _part_commands(), ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_every_part_parses_the_command_line_it_is_given(driver_untouched, part, args):
    mod = importlib.import_module(PARTS[part][0])
    ns = mod._parse(args)
    assert isinstance(ns, argparse.Namespace)
    if "--quick" in args:
        assert ns.quick is True
        assert ns.out == args[args.index("--out") + 1]


@pytest.mark.parametrize("part", list(PARTS))
def test_every_part_prints_its_help_without_a_gpu(driver_untouched, capsys, part):
    mod = importlib.import_module(PARTS[part][0])
    with pytest.raises(SystemExit) as exc:
        mod.main(["--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python")


@pytest.mark.parametrize("part", list(PARTS))
def test_every_part_exits_2_without_a_gpu(no_driver, capsys, part):
    mod = importlib.import_module(PARTS[part][0])
    args = QUICK[part][0] if part in QUICK else PARTS[part][1]
    assert mod.main(list(args)) == 2
    assert "no driver (test)" in capsys.readouterr().err


def test_launch_sizes_must_be_positive_integers(capsys):
    from benchmarks import launch_overhead

    assert launch_overhead._parse(["--sizes", "1,16"]).sizes == [1, 16]
    for bad in ("1,x", "0,4", ","):
        with pytest.raises(SystemExit):
            launch_overhead._parse(["--sizes", bad])


# ---------------------------------------------------------------- the run and its summary table


def _fake_part(name, doc_rows, *, raises=False):
    """A part module whose main writes a JSON of ``doc_rows`` where ``--out`` says, as this run."""
    mod = types.ModuleType(name)

    def main(argv):
        if raises:
            raise RuntimeError("part broke (test)")
        path = argv[argv.index("--out") + 1]
        with open(path, "w") as f:
            json.dump({"run_id": os.environ["CGRAW_RUN_ID"], "rows": doc_rows, "options": {"device": "cuda"}}, f)
        return 0

    mod.main = main
    return mod


LAUNCH_ROWS = [
    {"workload": "replay_1node", "system": "cgraw.replay", "submit_us": 3.0},
    {"workload": "replay_1node", "system": "raw cuGraphLaunch", "submit_us": 2.5},
    {"workload": "replay_1node", "system": "torch.cuda.CUDAGraph.replay", "submit_us": 4.0},
    {"workload": "chain", "framework": "torch", "n": 16, "system": "eager", "sync_us_per_kernel": 9.0,
     "device_us_per_kernel": 5.0},
    {"workload": "chain", "framework": "torch", "n": 256, "system": "eager", "sync_us_per_kernel": 8.0,
     "device_us_per_kernel": 5.0},
    {"workload": "chain", "framework": "torch", "n": 256, "system": "cgraw.replay", "sync_us_per_kernel": 1.2,
     "device_us_per_kernel": 1.1},
    {"workload": "chain", "framework": "torch", "n": 256, "system": "torch.cuda.CUDAGraph",
     "sync_us_per_kernel": 1.2, "device_us_per_kernel": 1.0},
]
GRAPHED_ROWS = [{"workload": "graphed_call", "k": 1, "cgraw_alternating_us": 9.0, "hand_cudagraph_copy_us": 10.0,
                 "reduce_overhead_us": 90.0, "floor_patch_and_launch_us": 4.5, "cgraw_same_us": 8.0,
                 "floor_raw_launch_us": 2.0}]


def test_the_quick_run_prints_one_summary_table_from_its_parts_json(monkeypatch, tmp_path, capsys):
    from benchmarks import __main__ as bm
    from cgraw import _cuda

    monkeypatch.setattr(_cuda, "driver_available", lambda: (True, ""))
    monkeypatch.setenv("CGRAW_RUN_ID", "run-under-test")
    monkeypatch.setitem(sys.modules, PARTS["launch"][0], _fake_part("fake_launch", LAUNCH_ROWS))
    monkeypatch.setitem(sys.modules, PARTS["graphed"][0], _fake_part("fake_graphed", GRAPHED_ROWS))
    monkeypatch.setitem(sys.modules, PARTS["models"][0], _fake_part("fake_models", [], raises=True))
    assert bm.main(["--out-dir", str(tmp_path / "out")]) == 1  # one part raised
    out = capsys.readouterr().out
    table = out[out.index("[benchmarks] summary of run run-under-test"):].splitlines()[1:]
    assert table[0].split() == ["part", "measure", "cgraw", "peer", "peer's", "cgraw/peer"]
    launch = [ln for ln in table if ln.startswith("launch")]
    assert any("1-node graph replay" in ln and ln.endswith("1.20") for ln in launch)  # 3.0 / 2.5
    assert any("torch chain of 256 kernels, host us per kernel" in ln and "torch eager" in ln and ln.endswith("0.15")
               for ln in launch)  # 1.2 / 8.0, at the longest chain
    graphed = [ln for ln in table if ln.startswith("graphed")]
    assert any("torch.cuda.CUDAGraph + copy_" in ln and ln.endswith("0.90") for ln in graphed)
    assert any("driver floor" in ln and ln.endswith("2.00") for ln in graphed)
    models = [ln for ln in table if ln.startswith("models")]
    assert len(models) == 1 and "the part ended with status raised" in models[0]
    assert sorted(os.listdir(tmp_path / "out")) == ["graphed_call_quick.json", "launch_overhead_quick.json"]


def test_the_summary_reads_only_this_runs_json(tmp_path):
    from benchmarks import summary

    path = tmp_path / "graphed_call_quick.json"
    assert summary.load(str(path), "now") == (None, f"no {path}")
    path.write_text(json.dumps({"run_id": "earlier", "rows": GRAPHED_ROWS}))
    doc, why = summary.load(str(path), "now")
    assert doc is None and "comes from run earlier, not this one" in why
    assert summary.load(str(path), None)[0] is None  # no part of this run wrote anything
    doc, why = summary.load(str(path), "earlier")
    assert why is None and doc["rows"] == GRAPHED_ROWS
    (row,) = summary.rows_for("graphed", None, why="no file")
    assert row[:2] == ("graphed", "no result: no file")


def test_the_summary_leaves_out_model_figures_that_do_not_count():
    """A cgraw row that did not replay every timed call, or a system that failed its check, has
    no figure in the table (``-``), as in the models part's own summary."""
    from benchmarks import summary

    def row(system, us, **kw):
        return {"workload": "gpt2_b1", "system": system, "unit": "call", "host_us": us, "check": "ok", **kw}

    doc = {"options": {"device": "cuda"}, "rows": [
        row("eager", 2600.0, check="reference"), row("cgraw_graphed", 290.0, graph_replayed=True),
        row("torch_cudagraph", 310.0), row("reduce_overhead", 175.0, check="differs from eager: x"),
        row("cgraw_over_compile", 170.0, graph_replayed=False)]}
    rows = summary.models_rows(doc)
    by_peer = {(r[1], r[3]): r for r in rows}
    per_call = "gpt2_b1, host us per call"
    assert by_peer[(per_call, "eager torch")][2:] == (290.0, "eager torch", 2600.0)
    assert by_peer[(per_call, "torch.cuda.CUDAGraph (hand-made)")][4] == 310.0
    assert by_peer[(per_call, "torch.compile reduce-overhead")][2:] == (290.0, "torch.compile reduce-overhead", None)
    over = by_peer[("gpt2_b1, cgraw over torch.compile, host us per call", "torch.compile reduce-overhead")]
    assert over[2] is None and over[4] is None
    lines = summary.table(rows).splitlines()
    assert next(ln for ln in lines if "eager torch" in ln).endswith("0.11")  # 290 / 2600
    assert next(ln for ln in lines if per_call in ln and "reduce-overhead" in ln).split()[-2:] == ["-", "-"]


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


def test_the_backend_is_judged_against_the_device_time_of_the_same_kernels_in_one_graph():
    """``cgraw_backend_host_over_kernels_device``: the backend's host µs over the device µs of
    ``cgraw_over_compile``'s bursts (Inductor's kernels replayed by one graph ahead of the host),
    never over the backend's own bursts, whose device time a host-bound system fills with waits."""
    from benchmarks import models

    def row(system, host, device, replayed=True):
        return {"system": system, "check": "ok", "host_us": host, "device_us": device, "graph_replayed": replayed}

    by_system = {"cgraw_backend": row("cgraw_backend", 210.0, 209.5), "reduce_overhead": row("reduce_overhead", 176.0, 175.5),
                 "cgraw_over_compile": row("cgraw_over_compile", 173.0, 172.5)}
    out = models._summary(by_system)
    assert out["cgraw_backend_host_over_kernels_device"] == pytest.approx(210.0 / 172.5)
    assert out["cgraw_backend_over_reduce_overhead_host"] == pytest.approx(210.0 / 176.0)
    by_system["cgraw_backend"]["graph_replayed"] = False  # its timed calls did not all replay: no figure
    assert models._summary(by_system)["cgraw_backend_host_over_kernels_device"] is None


def test_the_two_branch_eager_memory_program_runs_and_equals_eager_on_the_cpu(tmp_path):
    """``two_branch_eager`` (inputs alternating between two tensors, the eager reference between
    steps): its program logic on the CPU, eager system, every step equal to the reference."""
    pytest.importorskip("torch")
    out = tmp_path / "memory.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.memory", "--device", "cpu", "--programs", "two_branch_eager",
                           "--systems", "eager", "--mib", "1", "--steps", "4", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    child = json.loads(out.read_text())["children"]["two_branch_eager/eager"]
    assert child["result_checked"] is True and child["steps_bitwise_equal_to_eager"] == 4
    assert child["branches_taken"] == {"f2": 2, "f3": 2}


def test_backend_partitions_count_each_frames_last_compile():
    """A frame dynamo compiled twice stops calling its first compile's partition: the figures are
    those of the last compile's (the Llama decode step read "0 replays" from the first one's)."""
    from benchmarks.models import Partitions

    from cgraw.trees.nodes import FunctionStats

    def st(name, warmups, recordings, replays):
        s = FunctionStats(name)
        s.warmups, s.recordings, s.replays = warmups, recordings, replays
        return s

    stats = [st("bench [0/0] inference/partition 0 of 1", 1, 0, 0),
             st("bench [0/1] inference/partition 0 of 1", 1, 1, 318),
             st("bench [1/0] inference/partition 0 of 2", 1, 1, 300),
             st("bench [1/0] inference/partition 1 of 2", 1, 1, 299),
             st("other [0/0] inference/partition 0 of 1", 1, 0, 0)]
    mgr = types.SimpleNamespace(stats={i: s for i, s in enumerate(stats)})
    got = Partitions("bench").stats(mgr)
    assert got["partitions"] == 3 and got["compiles"] == {"0": 2, "1": 1}
    assert (got["warmups"], got["recordings"], got["replays"]) == (3, 3, 299)
    # a graph graphed whole (options={"whole_graph": True}) counts as its one piece
    whole = [st("bench [0/0] inference/whole graph", 1, 1, 318), st("other [0/0] inference/whole graph", 1, 0, 0)]
    got = Partitions("bench").stats(types.SimpleNamespace(stats=dict(enumerate(whole))))
    assert got["partitions"] == 1 and (got["recordings"], got["replays"]) == (1, 318)


def test_every_memory_program_runs_the_cgraw_backend_against_torchs_trees():
    """The backend is a system of each memory program by default, and its ratio to torch's trees
    (reduce-overhead) is reported before and after ``empty_cache``."""
    from benchmarks import memory

    for program in memory.PROGRAMS:
        assert {"cgraw_backend", "torch_trees", "cgraw"} <= set(memory.DEFAULT_SYSTEMS[program]), program
    assert "cgraw_backend" in memory.COMPILED  # compiled in a child with the compile timeout

    def row(system, grown, after):
        return {"program": "gpt2", "system": system, "grown_mib": grown, "grown_after_empty_cache_mib": after}

    ratios = memory._ratios([row("torch_trees", 200.0, 100.0), row("cgraw_backend", 190.0, 100.0),
                             row("eager", 50.0, 10.0)])["gpt2"]
    assert ratios["cgraw_backend/torch_trees"] == {"grown": pytest.approx(0.95, abs=1e-3),
                                                   "grown_after_empty_cache": pytest.approx(1.0)}
    assert "cgraw_backend/eager" in ratios


_FAKE_CHILD = r'''
import json, os, sys
tag, log, name = sys.argv[1], sys.argv[2], sys.argv[3]
def say(**m):
    sys.stdout.write(tag + json.dumps(m) + "\n"); sys.stdout.flush()
def note(what):
    with open(log, "a") as f:
        f.write(f"{name} {what} {os.environ['TORCHINDUCTOR_CACHE_DIR']}\n")
note("compiled")
say(phase="ready", workload=name.split("/")[0], system=name.split("/")[1], check="ok")
sys.stdin.readline()
note("warm")
for k in range(3):
    say(phase="turn")
    sys.stdin.readline()
    note(f"burst{k}")
say(phase="result", workload=name.split("/")[0], system=name.split("/")[1], check="ok", host_us=1.0)
'''


def test_each_system_runs_in_a_child_with_cold_caches_and_a_workloads_systems_take_turns_at_their_bursts(
        tmp_path, monkeypatch):
    """The children of ``benchmarks.models``, workload by workload: the systems that compile nothing
    start together, the compiled ones one at a time by default, each with its own empty cache
    directories; then the workload's children time one burst per turn, in rounds whose order is
    reversed every round, so a change of the machine's speed falls on every system alike; they
    close before the next workload's start."""
    from benchmarks import models

    log = tmp_path / "log"
    script = tmp_path / "child.py"
    script.write_text(_FAKE_CHILD)
    monkeypatch.setattr(models, "_child_cmd",
                        lambda w, s, args: [sys.executable, str(script), models.TAG, str(log), f"{w}/{s}"])
    added = []
    monkeypatch.setattr(models, "_add", lambda rep, rows, row: added.append(row))
    args = models._parse(["--quick"])
    pairs = [("wa", "eager"), ("wa", "reduce_overhead"), ("wa", "cgraw_backend"), ("wb", "eager")]
    finished = []
    models._children(None, {}, pairs, args, finished=lambda w: finished.append((w, len(added))))
    assert finished == [("wa", 3), ("wb", 4)]  # after each workload's rows are added

    lines = [ln.split() for ln in log.read_text().splitlines()]
    events = [(name, what) for name, what, _ in lines]
    assert len({cache for *_, cache in lines}) == 4  # a cache directory per child
    wa = [e for e in events if e[0].startswith("wa/")]
    # eager first, then the compiled systems one after another, before any timing
    assert wa[:3] == [("wa/eager", "compiled"), ("wa/reduce_overhead", "compiled"), ("wa/cgraw_backend", "compiled")]
    e, ro, be = "wa/eager", "wa/reduce_overhead", "wa/cgraw_backend"
    assert wa[3:] == [(e, "warm"), (ro, "warm"), (be, "warm"),
                      (e, "burst0"), (ro, "burst0"), (be, "burst0"),
                      (be, "burst1"), (ro, "burst1"), (e, "burst1"),
                      (e, "burst2"), (ro, "burst2"), (be, "burst2")]
    assert events.index(("wb/eager", "compiled")) > events.index((be, "burst2"))  # workload by workload
    assert [(r["workload"], r["system"], r.get("host_us"), r["compile_concurrency"]) for r in added] == [
        ("wa", "eager", 1.0, 1), ("wa", "reduce_overhead", 1.0, 1), ("wa", "cgraw_backend", 1.0, 1),
        ("wb", "eager", 1.0, 1)]


def test_a_models_run_stopped_early_keeps_the_workloads_it_finished(tmp_path, monkeypatch):
    """``benchmarks.models`` saves its JSON after every workload: a run stopped during its second
    workload keeps the first one's rows and ratios, marked incomplete, with the pairs it did not
    run; a run to its end is complete."""
    pytest.importorskip("torch")
    from benchmarks import models

    monkeypatch.setattr(models, "WORKLOADS", {"wa": ("json", "forward"), "wb": ("json", "forward")})
    stop_at = ["wb"]

    def children(rep, rows, pairs, args, finished=None):
        for w in dict.fromkeys(w for w, _ in pairs):
            if w in stop_at:
                raise KeyboardInterrupt  # the run is stopped here
            for s in (s for pw, s in pairs if pw == w):
                models._add(rep, rows, {"workload": w, "system": s, "check": "reference" if s == "eager" else "ok",
                                        "host_us": 4.0 if s == "eager" else 2.0, "device_us": 4.0 if s == "eager" else 2.0})
            finished(w)

    monkeypatch.setattr(models, "_children", children)
    out = tmp_path / "models.json"
    argv = ["--device", "cpu", "--only", "wa,wb", "--out", str(out)]
    with pytest.raises(KeyboardInterrupt):
        models.main(argv)
    doc = json.loads(out.read_text())
    assert doc["complete"] is False and doc["not_run"] == ["wb/eager", "wb/reduce_overhead"]
    assert [(r["workload"], r["system"], r["host_us"]) for r in doc["rows"]] == [("wa", "eager", 4.0),
                                                                               ("wa", "reduce_overhead", 2.0)]
    assert list(doc["summary"]) == ["wa"] and doc["rows"][1]["speedup_host"] == 2.0

    stop_at.clear()
    models.main(argv)
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and doc["not_run"] == [] and len(doc["rows"]) == 4


def test_a_memory_run_stopped_early_keeps_what_it_measured(tmp_path, monkeypatch):
    """``benchmarks.memory`` saves its JSON after every child: a run stopped during its third
    child keeps the first two, marked incomplete, with the pairs it did not run."""
    from benchmarks import memory

    ran = []

    def child(program, system, args):
        if len(ran) == 2:
            raise KeyboardInterrupt  # the run is stopped here
        ran.append((program, system))
        return {"program": program, "system": system, "grown_bytes": 2 * memory.MIB, "result_checked": True}

    monkeypatch.setattr(memory, "_run_child", child)
    out = tmp_path / "memory.json"
    with pytest.raises(KeyboardInterrupt):
        memory.main(["--device", "cpu", "--programs", "gpt2", "--systems", "eager,cgraw,torch_trees",
                     "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["complete"] is False and doc["not_run"] == ["gpt2/torch_trees"]
    assert [(r["program"], r["system"], r["grown_mib"]) for r in doc["rows"]] == [("gpt2", "eager", 2.0), ("gpt2", "cgraw", 2.0)]
    assert doc["ratios"]["gpt2"]["cgraw/eager"]["grown"] == 1.0

    ran.clear()
    memory.main(["--device", "cpu", "--programs", "gpt2", "--systems", "eager,cgraw", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and doc["not_run"] == [] and len(doc["rows"]) == 2


def test_the_models_plot_keeps_a_training_row_apart_and_withholds_a_speedup_the_benchmark_withheld():
    """``benchmarks.plots``: ResNet-18 inference and its training step share a model label unless
    the optimizer tells them apart; a row whose speedup the benchmark withheld (``speedup_note``)
    gets no bar from eager's time over its own."""
    from benchmarks import plots

    rows = [{"model": "resnet18", "batch": 8, "system": "eager", "host_us": 1000.0},
            {"model": "resnet18", "batch": 8, "system": "cgraw_graphed", "host_us": 500.0, "speedup_host": 2.0},
            {"model": "resnet18", "batch": 8, "optimizer": "SGD", "system": "eager", "host_us": 9000.0},
            {"model": "resnet18", "batch": 8, "optimizer": "SGD", "system": "cgraw_graphed", "host_us": 3000.0},
            {"model": "resnet18", "batch": 8, "optimizer": "SGD", "system": "cgraw_over_compile", "host_us": 2000.0,
             "speedup_host": None, "speedup_note": "cgraw did not replay every timed call"}]
    out = plots._speedups(rows, "host_us", "speedup_host")
    assert out["resnet18, batch 8"] == {"eager": 1.0, "cgraw_graphed": 2.0}
    assert out["resnet18, batch 8, optimizer SGD"] == {"eager": 1.0, "cgraw_graphed": 3.0}


def test_each_burst_of_the_models_benchmark_records_the_hosts_speed_beside_its_time(monkeypatch):
    """``benchmarks.models._bursts``: a fixed pure-Python loop is timed before every burst, so a row
    says whether its bursts ran while the host was fast or slow; per burst, beside the burst's time."""
    import time

    from benchmarks import models

    monkeypatch.setattr(models, "DEVICE", "cpu")
    res = models._bursts(lambda _: time.sleep(0.002), n=2, repeats=3)
    assert len(res["host_bursts_us"]) == len(res["host_ref_bursts_us"]) == len(res["host_ref_cpu_bursts_us"]) == 3
    assert all(0 < c <= r * 1.05 + 50 for c, r in zip(res["host_ref_cpu_bursts_us"], res["host_ref_bursts_us"]))
    assert res["threads"] >= 1
    assert all(h >= 1000 for h in res["host_bursts_us"]), res  # 2 ms per burst of 2 calls
    assert res["host_ref_us"] > 0
    assert res["host_ref_us"] == pytest.approx(sorted(res["host_ref_bursts_us"])[1], abs=0.1)  # their median


@pytest.mark.parametrize("system, cloned", [("reduce_overhead", True), ("cgraw_backend", False),
                                            ("cgraw_over_compile", False)])
def test_a_decode_step_is_given_the_last_token_cloned_only_under_reduce_overhead(monkeypatch, system, cloned):
    """``benchmarks.models``' decode loop as each system's users write it (``METHOD["decode"]``):
    torch's trees overwrite a previous generation's outputs, so reduce-overhead's loop clones the
    token; cgraw's systems take the step's output back as it is."""
    torch = pytest.importorskip("torch")
    from benchmarks import models

    out = torch.randn(1, 1)
    monkeypatch.setattr(models, "_make_call", lambda system, fn, extra=(), **kw: ((lambda tok, pos: out), None))
    given = []

    def check(wl, call, prefill):
        given.append(call(prefill(), None) is out)
        raise models.CheckFailed("enough")

    monkeypatch.setattr(models, "_check_decode", check)
    wl = models.Workload("llama_decode", "decode", {}, step=None, new_cache=lambda: None,
                         prefill=lambda cache: torch.randn(1, 1), positions=None)
    row = models._measure(wl, system, quick=True)
    assert given == [not cloned] and row["check"].startswith("differs")
    assert "reduce-overhead's loop clones it" in models.METHOD["decode"]
