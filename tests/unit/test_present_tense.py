"""CPU tier: the product, its tests and its manual say what is true now, not when it became true.

No "session N", "issue N", ``test_itemN_`` names, run ids (``20261201T120154Z-...``) or commit
hashes in ``cgraw/``, ``allocator/``, ``tests/``, ``benchmarks/`` and ``tools/`` source, nor in
the README and ``docs/``. What changed, and when, goes in ``CHANGELOG.md``; a benchmark's figures
name its JSON under ``benchmarks/results/``, and the JSON holds its run id and commit (neither is
scanned here).

A commit hash is a token of 7 to 40 hexadecimal digits that begins one of this repository's
commits (``git log``), wherever it stands (an all-decimal one only in backticks or after
"commit"/"run"/"on": otherwise it is a number); without git (or in a shallow clone, where most commits
are missing) tokens in backticks or after "commit"/"run"/"on" that mix digits and letters count too.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SELF = Path(__file__).resolve()

SOURCE_DIRS = ("cgraw", "allocator", "tests", "benchmarks", "tools")
SUFFIXES = {".py", ".pyi", ".c", ".h", ".cu", ".cuh", ".sh", ".md", ".txt", ".toml", ".cfg", ".ini"}
SKIP_PARTS = {"__pycache__", "results", ".pytest_cache", ".hypothesis"}  # benchmarks/results: records

HISTORY = [
    ("session number", re.compile(r"\bsessions? \d+", re.I)),
    ("issue number", re.compile(r"\bissue #?\d+", re.I)),
    ("issue numbers", re.compile(r"\bissues #?\d+(,| and)", re.I)),
    ("test named after an issue item", re.compile(r"\btest_item\d+")),
    ("run id", re.compile(r"\b\d{8}T\d{6}Z")),
]
HEX = re.compile(r"(?<![0-9A-Za-z_])[0-9a-f]{7,40}(?![0-9A-Za-z_])")
# without the repository's history: a hash in backticks, or named as a commit or run
HASH_IN_CONTEXT = re.compile(r"(?:`|\bcommits? |\brun |\bon )([0-9a-f]{7,40})(?![0-9A-Za-z_])", re.I)


def _commits() -> tuple[list[str], bool]:
    """This repository's full commit hashes, and whether that list is the whole history."""
    try:
        out = subprocess.run(["git", "log", "--all", "--format=%H"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
        shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT,
                                 capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return [], False
    if out.returncode != 0:
        return [], False
    hashes = out.stdout.split()
    return hashes, bool(hashes) and shallow.stdout.strip() != "true"


def _is_commit(token: str, commits: list[str]) -> bool:
    return any(h.startswith(token) for h in commits)


def _hash_like(token: str) -> bool:
    return any(c.isdigit() for c in token) and any(c.isalpha() for c in token)


def _findings(path: Path, commits: list[str], complete: bool) -> list[str]:
    rel = path.relative_to(ROOT)
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        for what, pattern in HISTORY:
            for m in pattern.finditer(line):
                out.append(f"{rel}:{n}: {what} {m.group(0)!r}: {line.strip()[:160]}")
        named = {m.group(1) for m in HASH_IN_CONTEXT.finditer(line)}
        for m in HEX.finditer(line):
            tok = m.group(0)  # all decimal (a count, a size): a hash only where named as one
            if (_hash_like(tok) or tok in named) and _is_commit(tok, commits):
                out.append(f"{rel}:{n}: commit hash {m.group(0)!r}: {line.strip()[:160]}")
        if not complete:
            for tok in named:
                if _hash_like(tok) and not _is_commit(tok, commits):
                    out.append(f"{rel}:{n}: commit-like token {tok!r}: {line.strip()[:160]}")
    return out


def _source_files() -> list[Path]:
    files = []
    for top in SOURCE_DIRS:
        base = ROOT / top
        if not base.is_dir():
            continue
        for p in sorted(base.rglob("*")):
            if not p.is_file() or p.suffix not in SUFFIXES or p.resolve() == SELF:
                continue
            if SKIP_PARTS.intersection(p.relative_to(ROOT).parts):
                continue
            files.append(p)
    return files


def _manual_files() -> list[Path]:
    files = [ROOT / "README.md"] if (ROOT / "README.md").is_file() else []
    if (ROOT / "docs").is_dir():
        files += sorted(p for p in (ROOT / "docs").rglob("*.md") if p.is_file())
    return files


def _report(files: list[Path]) -> list[str]:
    commits, complete = _commits()
    found = []
    for p in files:
        found += _findings(p, commits, complete)
    return found


def test_source_and_tests_say_nothing_of_sessions_issues_runs_or_commits():
    files = _source_files()
    assert len(files) > 100, f"only {len(files)} files found under {ROOT}"
    found = _report(files)
    assert not found, ("history in the source (say what is true now; what changed goes in "
                       "CHANGELOG.md):\n" + "\n".join(found))


def test_readme_and_docs_say_nothing_of_sessions_issues_runs_or_commits():
    found = _report(_manual_files())
    assert not found, ("history in the README or docs/ (a result names its JSON file; what changed goes "
                       "in CHANGELOG.md):\n" + "\n".join(found[:60]) + f"\n({len(found)} in all)")


def test_the_checks_catch_what_they_are_for(tmp_path, monkeypatch):
    """Each pattern fires on what it is for, and not on hexadecimal that names no commit."""
    commits, _ = _commits()
    lines = ["on by default since session 9", "see issue 12", "issues 8, 9", "issue #11",
             "def test_item3_something():", "run 20261201T120154Z-ebbb19a"]
    if commits:
        lines.append(f"fixed in {commits[-1][:7]}")
    quiet = ["colour #a1b2c3", "0xdeadbeef0", "CUDA error 700", "67108864 bytes", "3.14159265358979e0",
             "pytest session fixtures", "sessions of the GPU tier", "an issue with 3 kernels"]
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    noisy, calm = tmp_path / "noisy.py", tmp_path / "calm.py"
    noisy.write_text("\n".join(lines) + "\n")
    calm.write_text("\n".join(quiet) + "\n")
    flagged = {int(f.split(":")[1]) for f in _findings(noisy, commits, True)}
    assert flagged == set(range(1, len(lines) + 1)), flagged
    assert _findings(calm, commits, True) == []
    assert _findings(calm, commits, False) == []
    guessed = tmp_path / "guessed.md"  # without git: hashes named as such
    guessed.write_text("the memory run on 13a3336\nat commit 5a7b611\n(`ebbb19a`)\nrun deadbee\n")
    assert len(_findings(guessed, [], False)) == 3  # "deadbee" has no digit: a word, not a hash
