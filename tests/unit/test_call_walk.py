"""CPU tier: the replay path of a graphed call, module by module (``tools.call_walk``), is the one
``docs/architecture.md`` shows, with at most two returns to a module already left, for a call that
extends the path and for a root function's call that begins a generation."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _walks() -> dict[str, tuple[list[str], int]]:
    out = subprocess.run([sys.executable, "-m", "tools.call_walk"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    walks, case = {}, None
    for line in out.stdout.splitlines():
        if re.match(r"^\w+: ", line):
            case = line.split(":")[0]
        elif line.strip().startswith("stays:"):
            stays = [m.strip() for m in line.split(":", 1)[1].split("->")]
        elif "returns to a module already left" in line:
            walks[case] = (stays, int(re.search(r"(\d+) returns", line).group(1)))
    return walks


def test_a_replay_extending_the_path_runs_the_documented_modules():
    walks = _walks()
    stays, back = walks["path"]
    assert stays[0] == "trees.graphed" and stays[-1] == "trees.manager"
    assert "trees.calls" in stays and "trees.recording" in stays
    assert back == len(stays) - len(set(stays)) and back <= 2, stays
    doc = (ROOT / "docs" / "architecture.md").read_text()
    shown = " ".join(doc.split())  # the page wraps the sequence over lines
    assert " -> ".join(stays) in shown, "docs/architecture.md shows another path"


def test_a_root_call_classifies_and_replays_once():
    stays, _ = _walks()["root"]
    assert stays.count("trees.calls") <= 2 and stays.count("trees.recording") == 1, stays


def test_a_root_call_ending_a_generation_with_nothing_alive_leaves_the_manager_only_to_classify_and_replay():
    walks = _walks()
    stays, back = walks["root"]
    assert back == len(stays) - len(set(stays)) and back <= 2, stays
    assert stays == walks["path"][0], "a root call runs other modules than a call extending the path"
    held, _ = walks["held"]  # the last output is alive: the generation's end poisons it
    assert held.count("trees.calls") == 1 and held.count("trees.recording") == 1, held
