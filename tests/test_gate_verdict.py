"""The nightly report tells a verdict from a failure (issue 26): your evaluation
command's exit 1 is the check saying no, with its last lines as the reason; any
other code, a signal or the timeout is the check failing. And the gate's plot
draws the serving model's 50 % (no change, by definition) as a labelled line, not
as a series that reads as data."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from nightshift.nightly import report
from nightshift.judge.gate import GateSettings, gate
from nightshift.trainer.config import TrainConfig


@pytest.fixture
def candidate(tmp_path, tiny_model):
    """A candidate folder with no transitions to score on: only the command decides."""
    folder = tmp_path / "ck" / "v0002"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"version": "v0002", "base_model": str(tiny_model), "dataset": {}}))
    return folder, TrainConfig(base_model=str(tiny_model), data=str(tmp_path / "data"))


@pytest.mark.parametrize("command,timeout,passed,said", [
    ("echo 'candidate 70 % vs serving 75 %'; exit 1", 60, False,
     "the evaluation command said no (exit 1): candidate 70 % vs serving 75 %"),
    ("echo working; echo 'Traceback: KeyError' >&2; exit 2", 60, False,
     "the evaluation command failed (exit 2): working"),
    ("echo started; kill -9 $$", 60, False, "the evaluation command failed (killed by SIGKILL): started"),
    ("sleep 20", 1, False, "the evaluation command failed (timed out after 1 s): (it printed nothing)"),
    ("echo '{\"candidate_success\": 0.8}'", 60, True, "the evaluation command passed"),
])
def test_the_gate_says_what_the_command_said_and_whether_it_was_a_verdict(candidate, command, timeout, passed, said):
    folder, cfg = candidate
    d = gate(str(folder), None, cfg, GateSettings(command=command, timeout=timeout), log_dir=str(folder.parent))
    assert d.passed is passed
    assert d.reason.endswith(said), d.reason
    logged = [json.loads(line) for line in (folder.parent / "gate-log.jsonl").read_text().splitlines()]
    assert logged[-1]["command"]["verdict"] == ("passed" if passed else said.split("command ")[1].split(" (")[0])


def test_the_report_of_a_candidate_the_check_turned_down_says_no_not_failed(candidate):
    folder, cfg = candidate
    d = gate(str(folder), None, cfg, GateSettings(command="echo 'candidate 70 % vs serving 75 %'; exit 1"))
    run = {"run_id": "2026-11-26T02:15:00+00:00", "outcome": f"held back by the gate: {d.reason}", "gate": asdict(d),
           "gate_lines": d.lines()}
    md = report.markdown(run, [report.history_entry(run)], "latest.png")
    assert "failed" not in md
    assert "said no (exit 1): candidate 70 % vs serving 75 %" in md
    assert "**said no** (exit 1): candidate 70 % vs serving 75 %" in md  # its own section


def test_an_old_gate_log_entry_without_a_verdict_is_read_by_its_exit_code():
    from nightshift.judge.gate import command_how, command_verdict

    assert [command_verdict({"exit": c}) for c in (0, 1, 2, -9, None)] == [
        "passed", "said no", "failed", "failed", "failed"]
    assert command_how({"exit": -9}) == "killed by SIGKILL"


def _gate_axes(monkeypatch, tmp_path, history):
    import matplotlib.pyplot as plt

    kept = []
    monkeypatch.setattr(plt, "close", kept.append)
    report.plot(history, str(tmp_path / "no-data"), tmp_path / "p.png")
    (fig,) = kept
    return fig.axes[1]


def test_the_plot_draws_the_serving_models_fifty_percent_as_a_reference_line(monkeypatch, tmp_path):
    history = [{"run_id": f"2026-11-2{i}T02:15:00", "metric": "ranking_accuracy", "candidate_metric": c,
                "published_metric": 0.5, "published": c > 0.5} for i, c in enumerate((0.62, 0.41, 0.55))]
    ax = _gate_axes(monkeypatch, tmp_path, history)
    labels = {line.get_label(): line for line in ax.get_lines()}
    assert "serving before" not in labels  # no series of a value nobody measured
    (ref,) = [line for label, line in labels.items() if "by definition" in label]
    assert list(ref.get_ydata()) == [0.5, 0.5]
    assert list(labels["candidate"].get_ydata()) == [0.62, 0.41, 0.55]
    assert "50% by definition" in report.markdown({"run_id": "r"}, history, "p.png")


def test_a_measured_serving_score_is_still_drawn_as_a_series(monkeypatch, tmp_path):
    history = [{"run_id": "2026-11-20T02:15:00", "metric": "nll", "candidate_metric": 1.1, "published_metric": 1.3}]
    ax = _gate_axes(monkeypatch, tmp_path, history)
    labels = {line.get_label(): line for line in ax.get_lines()}
    assert list(labels["serving before"].get_ydata()) == [1.3]
    assert not [label for label in labels if "by definition" in label]
