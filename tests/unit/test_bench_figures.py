"""Benchmark figures quoted in docs/ can be checked from the repository: every figure table in a section about
a benchmark names the JSON it comes from, kept under docs/bench/ (tests.bench.report.KEPT_DIR), or says in
its section that the JSON was not kept; every kept file a doc names exists and says where it was measured, at a
commit of this history (so the code that produced it can be checked out)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
BENCH = re.compile(r"tests\.bench\.|tests/bench/|bench_\w+|runs/bench/")
KEPT = re.compile(r"docs/bench/([\w.-]+\.json)")
NOT_KEPT = "JSON not kept"


def sections(path: Path) -> list[tuple[str, str]]:
    """(heading, text) of each section of a Markdown file, split at headings outside code blocks."""
    out, heading, lines, fenced = [], path.name, [], False
    for line in path.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and line.startswith("#"):
            out.append((heading, "\n".join(lines)))
            heading, lines = f"{path.name}: {line.strip('# ')}", []
        lines.append(line)
    out.append((heading, "\n".join(lines)))
    return out


def figure_tables(text: str) -> list[str]:
    """The Markdown tables of `text` with a digit in a body row."""
    tables, rows = [], []
    for line in text.splitlines() + [""]:
        if line.lstrip().startswith("|"):
            rows.append(line)
            continue
        if len(rows) > 2 and any(re.search(r"\d", r) for r in rows[2:]):
            tables.append("\n".join(rows))
        rows = []
    return tables


BENCH_SECTIONS = [(h, t) for p in DOCS for h, t in sections(p) if BENCH.search(t) and figure_tables(t)]


def test_there_are_benchmark_tables_to_check():
    assert len(BENCH_SECTIONS) >= 5  # the parser finds the docs' benchmark tables (it would pass vacuously)


@pytest.mark.parametrize("heading,text", BENCH_SECTIONS, ids=[h for h, _ in BENCH_SECTIONS])
def test_each_benchmark_table_names_a_kept_json_or_says_it_is_not_kept(heading, text):
    kept = KEPT.findall(text)
    assert kept or NOT_KEPT in text, f"{heading}: name the docs/bench/<name>.json its figures come from"
    for name in kept:
        assert (ROOT / "docs" / "bench" / name).is_file(), f"{heading}: docs/bench/{name} is not in the repository"


KEPT_NAMED = sorted({m for p in DOCS for m in KEPT.findall(p.read_text())})


def test_docs_name_kept_benchmark_json():
    assert len(KEPT_NAMED) >= 5  # the parametrized check below would pass vacuously on none


def commit_of(result: dict) -> str:
    """The commit a kept result records: tests/bench/report.py's provenance, or (written before it) the bench's own key."""
    return result["provenance"]["commit"] if "provenance" in result else result["commit"]


@pytest.mark.parametrize("path", KEPT_NAMED)
def test_every_kept_json_says_where_it_was_measured(path):
    result = json.loads((ROOT / "docs" / "bench" / path).read_text())
    if "provenance" in result:  # tests/bench/report.py's
        prov = result["provenance"]
        cpus, load = prov["machine"]["cpus"], prov["machine"]["load_average_1_5_15"]["before"]
    else:  # written before the shared provenance, with the same facts at the top under the bench's own keys
        cpus = result["cpus"]
        load = next(result[k] for k in ("load_average_1m", "load_average", "load_avg_1m_before_after") if k in result)
    assert re.fullmatch(r"[0-9a-f]{7,40}", commit_of(result)) and cpus >= 1 and load, path


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def _no_history() -> str | None:
    """Why this checkout cannot answer "is that commit in my history", or None when it can."""
    shallow = _git("rev-parse", "--is-shallow-repository")
    if shallow.returncode != 0:
        return "not a git checkout (a source archive): there is no history to look the commits up in"
    if shallow.stdout.strip() == "true":
        return "a shallow clone: commits older than its depth are not here (clone with full history to check them)"
    return None


KEPT_FILES = sorted(p.name for p in (ROOT / "docs" / "bench").glob("*.json"))


@pytest.mark.parametrize("path", KEPT_FILES)
def test_every_kept_json_was_measured_at_a_commit_of_this_history(path):
    """A commit rebased away leaves a hash nobody can check out: each kept result's commit is an ancestor of HEAD."""
    why = _no_history()
    if why:
        pytest.skip(why)
    commit = commit_of(json.loads((ROOT / "docs" / "bench" / path).read_text()))
    ancestor = _git("merge-base", "--is-ancestor", commit, "HEAD")
    assert ancestor.returncode == 0, (f"docs/bench/{path}: its commit {commit} is not in this branch's history "
                                      f"(re-run the bench at a commit of it and keep that JSON) {ancestor.stderr}")
