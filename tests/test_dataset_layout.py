"""The dataset layout is part of the contract (issue 28, item 4): where each dataset
lives and the columns each reader needs come from `schemas/`, and every reader holds
what it opens to them. A dataset of a future schema version, or one missing a column
a reader needs, is one sentence naming the file and exit 2 through the reader's
command: never a Polars traceback, never a column read with a meaning it lost."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from nightshift.cli.main import main
from nightshift.schemas import layout, transitions
from nightshift.schemas.common import METADATA_VERSION
from transitions_data import row, write

FUTURE = b"99"


def _rewrite(path: Path, *, version: bytes | None = None, drop: str | None = None) -> None:
    """The file as a newer Nightshift (`version`) or a hand (`drop`) would have left it."""
    t = pq.read_table(path)
    meta = dict(t.schema.metadata or {})
    if version is not None:
        meta[METADATA_VERSION] = version
    if drop is not None:
        t = t.drop([drop])
    pq.write_table(t.replace_schema_metadata(meta), path)


def _one_sentence(err: str, path: Path) -> str:
    """What the command said: one line naming the file, no traceback."""
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err and "Error:" not in err, err
    assert str(path) in lines[0], err
    return lines[0]


def _transitions(tmp_path: Path) -> tuple[Path, Path]:
    """Two dates of transitions; the second file is the one the tests spoil (a reader
    must check every file, not the first one's schema only)."""
    data = tmp_path / "data"
    write(data, [row("q1", "a1", 1.0, trajectory="t" * 32)], date="2026-11-19")
    return data, write(data, [row("q2", "a2", 0.0, trajectory="u" * 32)], date="2026-11-20")


# --- the schema's declarations and the check itself -------------------------------------------


def test_every_dataset_declares_its_versions_and_its_readers_need_only_its_columns():
    for name, module in layout.DATASETS.items():
        assert module.READABLE and module.READABLE[-1] == module.SCHEMA.metadata[METADATA_VERSION].decode()
        for reader, cols in module.READERS.items():
            assert cols and set(cols) <= set(module.SCHEMA.names), (name, reader)


def test_a_version_1_transitions_file_is_read_without_the_columns_version_2_added(tmp_path):
    data, spoiled = _transitions(tmp_path)
    t = pq.read_table(spoiled).drop(list(transitions.ADDED["2"]))
    pq.write_table(t.replace_schema_metadata({**t.schema.metadata, METADATA_VERSION: b"1"}), spoiled)
    import fsspec

    fs = fsspec.filesystem("file")
    assert layout.check_file(fs, str(spoiled), "transitions", "nightshift prompts") == "1"
    # the same columns missing from a version 2 file are missing
    _rewrite(spoiled, version=b"2")
    with pytest.raises(layout.LayoutError, match="lacks the column\\(s\\) prompt_name, prompt_version"):
        layout.check_file(fs, str(spoiled), "transitions", "nightshift prompts", also=transitions.ADDED["2"])


def test_a_file_of_another_dataset_is_named_as_such(tmp_path):
    import fsspec

    data, spoiled = _transitions(tmp_path)
    t = pq.read_table(spoiled)
    pq.write_table(t.replace_schema_metadata({**t.schema.metadata, b"nightshift.schema": b"spans"}), spoiled)
    with pytest.raises(layout.LayoutError, match="holds the spans dataset, not transitions"):
        layout.check_file(fsspec.filesystem("file"), str(spoiled), "transitions", "nightshift train")


# --- each reader, through its command ---------------------------------------------------------


@pytest.mark.parametrize("spoil", ["future", "missing"])
def test_train_refuses_transitions_it_cannot_read_with_one_sentence_and_exit_2(tmp_path, capsys, spoil):
    data, spoiled = _transitions(tmp_path)
    _rewrite(spoiled, **({"version": FUTURE} if spoil == "future" else {"drop": "reward"}))
    # selection runs before any model is loaded: no base model needed to be refused
    assert main(["train", "--data", str(data), "--base-model", str(tmp_path / "no-model")]) == 2
    said = _one_sentence(capsys.readouterr().err, spoiled)
    read = said.split("reads version", 1)[-1]  # every version this Nightshift reads, named
    assert ("transitions schema version 99" in said and all(v in read for v in transitions.READABLE)
            if spoil == "future"
            else "lacks the column(s) reward that nightshift train needs" in said)


def _only(path: Path, dataset: str, reader: str) -> None:
    """The file cut down to the columns `reader` declares it needs, and nothing else."""
    t = pq.read_table(path)
    pq.write_table(t.select(list(layout.needs(dataset, reader))).replace_schema_metadata(t.schema.metadata), path)


@pytest.mark.parametrize("spoil", ["future", "missing"])
def test_prompts_refuses_transitions_it_cannot_read_with_one_sentence_and_exit_2(tmp_path, capsys, spoil):
    data, spoiled = _transitions(tmp_path)
    _rewrite(spoiled, **({"version": FUTURE} if spoil == "future" else {"drop": "input_messages"}))
    assert main(["prompts", "--data", str(data)]) == 2
    said = _one_sentence(capsys.readouterr().err, spoiled)
    assert ("transitions schema version 99" in said if spoil == "future"
            else "lacks the column(s) input_messages that nightshift prompts needs" in said)


def test_prompts_reads_transitions_holding_only_the_columns_it_declares(tmp_path, capsys):
    data, spoiled = _transitions(tmp_path)
    for p in sorted((data / "transitions").rglob("*.parquet")):
        _only(p, "transitions", "nightshift prompts")
    assert main(["prompts", "--data", str(data), "--json"]) == 0, capsys.readouterr().err


def _spans(tmp_path: Path) -> tuple[Path, Path]:
    """Two batches of spans from the collector's own writer; the second is spoiled."""
    from traces import Trace, genai_call, write_spans

    data = tmp_path / "data"
    for seed in ("a", "b"):
        t = Trace(seed)
        root = t.span("invoke_agent solver", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "solver"},
                      start=0, end=5)
        t.span("chat m1", genai_call("task", "answer"), parent=root, start=1, end=2)
        write_spans(data, [t], batch=seed)
    (spoiled,) = (data / "spans").rglob(layout.batch_file("b"))
    return data, spoiled


@pytest.mark.parametrize("spoil", ["future", "missing"])
def test_build_refuses_spans_it_cannot_read_with_one_sentence_and_exit_2(tmp_path, capsys, spoil):
    data, spoiled = _spans(tmp_path)
    _rewrite(spoiled, **({"version": FUTURE} if spoil == "future" else {"drop": "service_name"}))
    assert main(["build", "--data", str(data), "--quiet", "--settle", "0"]) == 2
    said = _one_sentence(capsys.readouterr().err, spoiled)
    assert ("spans schema version 99" in said and "reads version 1" in said if spoil == "future"
            else "lacks the column(s) service_name that nightshift build needs" in said)
    assert not (data / "transitions").exists() or not list((data / "transitions").rglob("*.parquet"))


def test_build_reads_spans_holding_only_the_columns_it_declares(tmp_path, capsys):
    data, _ = _spans(tmp_path)
    for p in sorted((data / "spans").rglob("*.parquet")):
        _only(p, "spans", "nightshift build")
    assert main(["build", "--data", str(data), "--quiet", "--settle", "0"]) == 0, capsys.readouterr().err
    assert len(list((data / "transitions").rglob("*.parquet"))) == 1



@pytest.mark.parametrize("spoil", ["future", "missing"])
def test_versions_refuses_transitions_it_cannot_read_with_one_sentence_and_exit_2(tmp_path, capsys, spoil):
    data, spoiled = _transitions(tmp_path)
    _rewrite(spoiled, **({"version": FUTURE} if spoil == "future" else {"drop": "policy_version"}))
    assert main(["versions", "--data", str(data)]) == 2
    said = _one_sentence(capsys.readouterr().err, spoiled)
    assert ("transitions schema version 99" in said if spoil == "future"
            else "lacks the column(s) policy_version that nightshift versions needs" in said)


def test_versions_reads_transitions_holding_only_the_columns_it_declares(tmp_path, capsys):
    data, _ = _transitions(tmp_path)
    for p in sorted((data / "transitions").rglob("*.parquet")):
        _only(p, "transitions", "nightshift versions")
    assert main(["versions", "--data", str(data)]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("spoil", ["future", "missing"])
def test_the_nightly_report_refuses_transitions_it_cannot_read_with_one_sentence_and_exit_2(tmp_path, capsys,
                                                                                         monkeypatch, spoil):
    """No spans: the build has nothing to do and the run goes straight to its report,
    which reads the transitions (the reward per day, the reward by version)."""
    data, spoiled = _transitions(tmp_path)
    _rewrite(spoiled, **({"version": FUTURE} if spoil == "future" else {"drop": "reward"}))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NIGHTSHIFT_TRAIN_BASE_MODEL", str(tmp_path / "no-model"))
    assert main(["nightly", "--data", str(data), "--quiet"]) == 2
    err = capsys.readouterr().err  # the run's progress is logged on stderr too: the sentence is one line of it
    assert "Traceback" not in err, err
    (said,) = [ln for ln in err.splitlines() if str(spoiled) in ln]
    assert said.startswith("nightshift nightly: "), err
    assert ("transitions schema version 99" in said if spoil == "future"
            else re.search(r"lacks the column\(s\) reward that (nightshift versions|the nightly report) needs", said))
    assert not list(tmp_path.rglob("latest.md"))  # no report that reads the data wrong



def test_watch_refuses_transitions_it_cannot_read_and_rolls_nothing_back(tmp_path, capsys):
    """The watch judges the serving version by `nightshift versions`' reader: a future
    version's rows read as this one's could roll a good version back."""
    from nightshift.publish import registry

    data, spoiled = _transitions(tmp_path)
    _rewrite(spoiled, version=FUTURE)
    ck = tmp_path / "ck"
    registry.append(str(ck), {"version": "v0001", "name": "agent@v0001", "endpoint": "http://127.0.0.1:9",
                              "mode": "lora", "path": "/x", "checkpoint": str(ck / "v0001")})
    args = ["watch", "--data", str(data), "--checkpoints", str(ck), "--vllm-url", "http://127.0.0.1:9",
            "--name", "agent"]
    assert main(args) == 2
    assert "transitions schema version 99" in _one_sentence(capsys.readouterr().err, spoiled)
    assert registry.current(str(ck))["version"] == "v0001" and not (ck / "gate-log.jsonl").exists()



@pytest.mark.parametrize("spoil", ["future", "missing"])
def test_export_refuses_transitions_it_cannot_read_with_one_sentence_and_exit_2(tmp_path, capsys, spoil):
    data, spoiled = _transitions(tmp_path)
    _rewrite(spoiled, **({"version": FUTURE} if spoil == "future" else {"drop": "output_message"}))
    out = tmp_path / "sft.jsonl"
    assert main(["export", "--data", str(data), "--to", str(out)]) == 2
    said = _one_sentence(capsys.readouterr().err, spoiled)
    assert ("transitions schema version 99" in said if spoil == "future"
            else "lacks the column(s) output_message that nightshift export needs" in said)
    assert not out.exists() and not list(tmp_path.glob(".sft.jsonl.*"))  # nothing half-written



def test_every_reader_still_reads_a_lake_of_transitions_version_1(tmp_path, capsys):
    """Files written before the columns later versions added: read, those columns null."""
    data, _ = _transitions(tmp_path)
    later = [c for v, cols in transitions.ADDED.items() for c in cols]
    for p in sorted((data / "transitions").rglob("*.parquet")):
        t = pq.read_table(p)
        pq.write_table(t.drop(later).replace_schema_metadata({**t.schema.metadata, METADATA_VERSION: b"1"}), p)
    for args in (["versions"], ["prompts"], ["export", "--to", str(tmp_path / "sft.jsonl")]):
        assert main([*args, "--data", str(data)]) == 0, capsys.readouterr().err


# --- one place spells the layout --------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
#: Stages that read or write the lake, or may one day: all but schemas/ (which owns the layout).
STAGES = ("collector", "transform", "trainer", "publish", "judge", "nightly", "prompts", "cli", "serve", "route")
#: A string that builds a dataset path: a partition (`date=`), a dataset folder after a
#: root (`{root}/spans/…`), a dataset's glob, a collector file's name.
SPELLED = [re.compile(p) for p in (r"date=", r"(?<!/v1)/(spans|logs|feedback|transitions)(/|$)",
                                   r"^(spans|logs|feedback|transitions)/", r"\*\*/\*\.parquet",
                                   r"part-.*\.parquet")]


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def test_no_module_outside_schemas_spells_the_layout():
    found = []
    for stage in STAGES:
        for path in sorted((ROOT / stage).rglob("*.py")) if (ROOT / stage).is_dir() else []:
            tree = ast.parse(path.read_text(), str(path))
            skip = _docstrings(tree)
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in skip:
                    continue
                # prose for a person (help, messages) names `<data>/…` or `YYYY-MM-DD`: not a path built
                if "<data>" in node.value or "YYYY" in node.value:
                    continue
                if any(p.search(node.value) for p in SPELLED):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not found, "spell these with nightshift.schemas.layout:\n" + "\n".join(found)
