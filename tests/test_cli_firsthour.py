"""A new user's first hour with the small commands (issue 26): what `show`,
`ingest`, `build` and the demo say must be true and must not get in the way.

Each test failed on the code before its fix (see the commit that added it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl

from nightshift.cli.main import main
from test_fileingest import json_lines, logs, traces

ROOT = Path(__file__).resolve().parents[1]
DOCTOR = Path(__file__).parent / "fixtures" / "doctor"


def _copy(case: str, tmp_path: Path) -> Path:
    data = tmp_path / "data"
    shutil.copytree(DOCTOR / case / "spans", data / "spans")
    return data


def test_show_counts_each_trace_once(tmp_path, capsys):
    """`show` summed per-group unique counts: a trace with agent spans and LLM-call
    spans (two groups of its summary table) was counted twice."""
    data = _copy("episode_reward", tmp_path)  # 2 real traces: episode, agent and chat spans in each
    truth = pl.read_parquet(str(data / "spans" / "**" / "*.parquet"))["trace_id"].n_unique()
    assert truth == 2
    assert main(["show", "--data", str(data), "--rows", "3"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == f"spans under {data}: 13 in {truth} trace(s)", first


def test_show_counts_a_span_stored_twice_once(tmp_path, capsys):
    """A span can lie in the lake twice: a collector's retry past its duplicate
    check, or a compaction stopped between putting its merged file in place and
    removing the inputs. The build keeps one copy; `show` counted both."""
    data = _copy("episode_reward", tmp_path)
    first = sorted((data / "spans").rglob("*.parquet"))[0]
    shutil.copy(first, first.with_name("copy-" + first.name))  # every row of that file twice
    assert main(["show", "--data", str(data), "--rows", "50"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"spans under {data}: 13 in 2 trace(s)", out
    assert sum(int(x) for x in _column(out, "spans")) == 13


def _column(table: str, name: str) -> list[str]:
    """A column's cells from Polars' printed table."""
    rows = [r for r in table.splitlines() if r.startswith("│")]
    head = [c.strip() for c in rows[0].strip("│").split("┆")]
    i = head.index(name)
    return [c.strip() for r in rows[1:] for c in [r.strip("│").split("┆")[i]] if c.strip().isdigit()]


def test_ingesting_a_file_again_reports_it_already_stored(tmp_path, capsys):
    """The second ingest of the same file (a new process, as users run it) said
    "5 spans ... written; 0 already stored" although it added nothing."""
    f = tmp_path / "export.json"
    f.write_bytes(json_lines(traces(1, 5)) + json_lines(logs("a", "b")))
    data = tmp_path / "data"
    args = ["ingest", "--data", str(data), "--quiet", str(f)]
    assert main(args) == 0
    assert "5 spans, 2 log records written; 0 already stored" in capsys.readouterr().out
    files = sorted(p.relative_to(data) for p in data.rglob("*.parquet"))
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "0 spans, 0 log records written; 7 already stored" in out, out
    assert sorted(p.relative_to(data) for p in data.rglob("*.parquet")) == files  # nothing rewritten or added
    assert pl.read_parquet(str(data / "spans" / "**" / "*.parquet")).height == 5


def test_ingest_draws_no_progress_bar_into_a_pipe(tmp_path):
    """tqdm's bar (carriage returns, `%|`) went into pipes and logs."""
    f = tmp_path / "export.json"
    f.write_bytes(json_lines(traces(1, 3)))
    p = subprocess.run([sys.executable, "-m", "nightshift.cli", "ingest", "--data", str(tmp_path / "data"), str(f)],
                       capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert p.returncode == 0, p.stderr
    assert "%|" not in p.stderr and "\r" not in p.stderr, p.stderr
    assert "3 spans" in p.stdout


def test_demo_help_prints_help_and_starts_nothing(tmp_path):
    """`python examples/demo.py --help` started the whole demo (a model build, a
    collector, a server)."""
    env = {**os.environ, "NIGHTSHIFT_DATA": str(tmp_path / "demo-data")}
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py"), "--help"], capture_output=True, text=True,
                       timeout=60, env=env, cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: demo.py"), p.stdout
    assert "DEMO_EPISODES" in p.stdout and "make demo" in p.stdout
    assert not (tmp_path / "demo-data").exists()


def test_demo_refuses_an_unknown_argument(tmp_path):
    env = {**os.environ, "NIGHTSHIFT_DATA": str(tmp_path / "demo-data")}
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py"), "--episodes", "3"], capture_output=True,
                       text=True, timeout=60, env=env, cwd=str(tmp_path))
    assert p.returncode == 2 and "unrecognized arguments: --episodes" in p.stderr, p.stderr
    assert not (tmp_path / "demo-data").exists()


def test_build_ends_with_the_fix_for_each_gap(tmp_path, capsys):
    """`build` printed `0 rows ... waiting to settle: N` and `without a reward: N` and
    exited 0, with no hint of --settle, --reward-keys or feedback."""
    data = _copy("episode_reward", tmp_path)
    assert main(["build", "--data", str(data), "--quiet", "--settle", "1s"]) == 0  # recorded spans are older: built
    out = capsys.readouterr().out
    assert "trajectories without a reward: 2" in out
    assert "hint:" in out and "--reward-keys" in out and "nightshift feedback" in out, out
    assert main(["build", "--data", str(data), "--quiet", "--settle", "100000h"]) == 0
    out = capsys.readouterr().out
    assert "trajectories waiting to settle (next run): 2" in out
    assert "--settle 0" in out and "NIGHTSHIFT_TRANSFORM_SETTLE" in out, out
    assert main(["build", "--data", str(data), "--quiet", "--settle", "1s", "--reward-keys", "episode.reward"]) == 0
    assert "hint:" not in capsys.readouterr().out  # nothing to fix: no hints



def test_collect_help_names_what_an_agent_needs(capsys):
    """`collect --help` ended "Agents need only OTEL_EXPORTER_OTLP_ENDPOINT": they also
    need an instrumentation and its content switch, or a day of spans has no messages."""
    try:
        main(["collect", "--help"])
    except SystemExit as e:
        assert e.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Agents need only" not in out
    for needed in ("opentelemetry-instrumentation-openai-v2", "opentelemetry-instrument python",
                   "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY", "nightshift doctor"):
        assert needed in out, needed
