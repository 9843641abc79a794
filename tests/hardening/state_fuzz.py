#!/usr/bin/env python
"""Fuzzing campaign for the small state files beside the checkpoints: the
registry (`published.json`), the decisions log (`gate-log.jsonl`), the nightly
job's state (`.nightly/state.json`) and run history (`.nightly/runs.jsonl`).

    python tests/hardening/state_fuzz.py                      # 3,000 cases
    python tests/hardening/state_fuzz.py --cases 20000 --write-docs
    python tests/hardening/state_fuzz.py --replay 7:123       # one case again, printed

Each case writes one file, malformed (truncated, invalid UTF-8, a list or null
where an object belongs, wrong types, missing fields, nesting too deep, an
unknown pending change) or odd but valid (huge, thousands of duplicate entries,
versions no folder holds, unknown extra fields), then runs what reads it, in
process through the CLI's `main(argv)` against an in-process stand-in of vLLM's
adapter API (vllm_standin.py, which records every request):

- published.json: `nightshift versions`, `watch --dry-run`, `rollback`,
  `publish`, and the nightly report's readers (every 50th case the whole report,
  with its plot);
- gate-log.jsonl: the report's readers, then one more decision appended, which
  must read back whole (never glued to a torn line);
- state.json: `nightshift nightly` (a state it cannot resume from is refused
  before anything runs; a valid one is read);
- runs.jsonl: the report's history and its Markdown.

Checked on every case: no exception escapes a command and no traceback is
printed; a registry the generator broke is refused by every command that could
change the server with exit 2 and one line naming the file, the stand-in got
no request at all and the file is unchanged; a valid registry is never refused;
a broken state file is refused by `nightly` with exit 2, naming it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from vllm_standin import Standin, fake_adapter  # noqa: E402

NAME = "agent"
STABLE = "agent-live"
TRACEBACK = "Traceback (most recent call last)"


@dataclass
class Case:
    target: str  # registry | gatelog | state | history
    kind: str  # the generator
    body: bytes
    valid: bool  # a registry commands may act on / a state nightly may resume from


# -- generators ------------------------------------------------------------------------------


def _entries(endpoint: str) -> list[dict]:
    """A registry as publishing writes it: two publications, a rollback, a stopped canary."""
    def pub(v: str, t: str, **kw) -> dict:
        return {"version": v, "name": f"{NAME}@{v}", "stable_name": STABLE, "path": f"/adapters/{v}",
                "endpoint": endpoint, "mode": "lora", "checkpoint": f"/ck/{v}", "rollback_of": None,
                "time": f"2026-11-2{t}T02:15:00+00:00", **kw}
    return [pub("v0001", "0"), pub("v0002", "1"), pub("v0001", "2", rollback_of="v0002"),
            {**pub("v0003", "3"), "role": "canary", "share": 0.3, "route": "http://127.0.0.1:8100",
             "serving": "v0001", "serving_name": f"{NAME}@v0001", "stable": STABLE},
            {"version": "v0003", "name": f"{NAME}@v0003", "endpoint": endpoint, "role": "canary_end",
             "outcome": "stopped", "why": "worse", "time": "2026-11-24T02:15:00+00:00"}]


def _doc(entries: list[dict], **extra) -> dict:
    return {"current": entries[-1] if entries else None, "history": entries, **extra}


def _dump(obj) -> bytes:
    return json.dumps(obj, indent=2).encode()


#: for each field, values no entry may hold there
BAD_VALUES = {
    "version": [None, 3, -1.5, True, "", [], {}, "../../etc", "/abs/v1", "v 1", ".hidden"],
    "name": [None, 3, True, "", [], {}], "endpoint": [None, 3, True, "", [], {}],
    "time": [None, 3, True, "", [], {}, "yesterday"],
    "path": [3, True, [], {}], "checkpoint": [3, True, [], {}], "rollback_of": [3, True, [], {}],
}


def _registry(rng: random.Random, endpoint: str) -> Case:
    entries = _entries(endpoint)
    good = _dump(_doc(entries))
    kind = rng.choice(["truncated", "empty", "not_utf8", "top_level", "history_type", "entry_type", "missing_field",
                       "field_type", "bad_time", "bad_role", "bad_canary", "pending_garbage", "deep", "bom",
                       "huge_text", "many_entries", "duplicates", "unknown_versions", "extra_fields", "valid_pending",
                       "valid"])
    if kind == "truncated":
        return Case("registry", kind, good[: rng.randrange(1, len(good) - 1)], False)
    if kind == "empty":
        return Case("registry", kind, rng.choice([b"", b"   \n", b"\n\n"]), False)
    if kind == "not_utf8":
        at = rng.randrange(len(good))
        bad = rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80", b"\xfe\xff"])
        return Case("registry", kind, good[:at] + bad + good[at:], False)
    if kind == "top_level":
        return Case("registry", kind, _dump(rng.choice([entries, None, "published", 42, True, [_doc(entries)], {}])),
                    False)
    if kind == "history_type":
        return Case("registry", kind, _dump({"current": None, "history": rng.choice([None, {}, "v0001", 7, {"0": 1}])}),
                    False)
    i = rng.randrange(len(entries))
    if kind == "entry_type":
        entries[i] = rng.choice([None, [], "v0001", 5, [entries[i]]])
        return Case("registry", kind, _dump(_doc(entries)), False)
    if kind == "missing_field":
        key = rng.choice(["version", "time", "name", "endpoint"] + (["mode"] if "role" not in entries[i] or
                                                                    entries[i]["role"] == "canary" else []))
        del entries[i][key]
        return Case("registry", kind, _dump(_doc(entries)), False)
    if kind == "field_type":
        key = rng.choice(list(BAD_VALUES))
        entries[i][key] = rng.choice(BAD_VALUES[key])
        return Case("registry", kind, _dump(_doc(entries)), False)
    if kind == "bad_time":
        entries[i]["time"] = rng.choice(["yesterday", "2026-13-45", "", "2026-11-20 25:00", 1763600000])
        return Case("registry", kind, _dump(_doc(entries)), False)
    if kind == "bad_role":
        if rng.random() < 0.5:
            entries[i]["role"] = rng.choice(["boss", "", 3, ["canary"]])
        else:
            entries[i]["mode"] = rng.choice(["half", None, 1]) if entries[i].get("role") != "canary_end" else "x"
            if entries[i].get("role") == "canary_end":
                entries[i]["outcome"] = rng.choice(["maybe", None, 1])
        return Case("registry", kind, _dump(_doc(entries)), False)
    if kind == "bad_canary":
        c = entries[3]
        what = rng.choice(["serving", "serving_name", "share"])
        if what == "share":
            c["share"] = rng.choice(["abc", 2.0, -0.1, float("nan"), True])
        else:
            del c[what]
        return Case("registry", kind, _dump(_doc(entries)), False)
    if kind == "pending_garbage":
        pending = rng.choice(["publish", [], 3, {"op": "explode", "endpoint": endpoint},
                              {"op": "publish"}, {"op": "publish", "endpoint": endpoint, "entries": []},
                              {"op": "publish", "endpoint": endpoint, "entries": [{"version": 3}]},
                              {"op": "canary_start", "endpoint": endpoint, "entries": [entries[0]], "route": "x"},
                              {"op": "publish", "endpoint": endpoint, "entries": [entries[0]], "before": [1]},
                              {"op": "canary_stop", "endpoint": endpoint, "entries": [entries[4]], "unload": "x"},
                              {"op": "publish", "endpoint": endpoint, "entries": [entries[0]], "lora_name": "a",
                               "path": "/p", "mode": "half"},
                              {"op": "canary_promote", "endpoint": endpoint, "entries": [entries[0]],
                               "lora_name": "a", "path": "/p", "route": {"url": "u", "stable": "s", "want": 3}}])
        return Case("registry", kind, _dump(_doc(entries, pending=pending)), False)
    if kind == "deep":
        depth = rng.choice([2000, 50_000, 200_000])
        body = rng.choice([b"[" * depth + b"]" * depth, b'{"history": ' + b"[" * depth + b"]" * depth + b"}"])
        return Case("registry", kind, body, False)
    if kind == "bom":
        return Case("registry", kind, b"\xef\xbb\xbf" + good, False)
    if kind == "huge_text":
        entries[i]["why" if entries[i].get("role") else "note"] = "x" * rng.choice([100_000, 2_000_000])
        return Case("registry", kind, _dump(_doc(entries)), True)
    if kind == "many_entries":
        return Case("registry", kind, _dump(_doc(entries[:2] * rng.choice([500, 5000]) + entries[2:])), True)
    if kind == "duplicates":
        return Case("registry", kind, _dump(_doc(entries + [dict(e) for e in entries])), True)
    if kind == "unknown_versions":
        extra = [{**entries[1], "version": v, "name": f"{NAME}@{v}", "time": "2026-11-25T00:00:00+00:00"}
                 for v in ("v0999", "v0500")]
        return Case("registry", kind, _dump(_doc(entries + extra)), True)
    if kind == "extra_fields":
        entries[i]["surprise"] = rng.choice([None, [1, 2], {"a": "b"}, "text"])
        return Case("registry", kind, _dump(_doc(entries, extra={"x": 1})), True)
    if kind == "valid_pending":  # a publication of v0002 killed after it began
        c = {"op": "publish", "endpoint": endpoint, "entries": [{k: v for k, v in entries[1].items() if k != "time"}],
             "lora_name": f"{NAME}@v0002", "path": "/adapters/v0002", "stable_name": STABLE, "mode": "lora",
             "before": {f"{NAME}@v0002": None, STABLE: None}, "route": None, "unload": ""}
        return Case("registry", kind, _dump(_doc(entries, pending=c)), True)
    return Case("registry", "valid", good, True)


def _jsonl(rng: random.Random, good: list[dict], target: str) -> Case:
    lines = [json.dumps(e).encode() for e in good]
    kind = rng.choice(["torn_last", "not_utf8", "not_object", "huge_line", "deep", "blank_lines", "crlf", "null",
                       "valid"])
    if kind == "torn_last":
        last = lines[-1]
        lines[-1] = last[: rng.randrange(1, len(last))]
        return Case(target, kind, b"\n".join(lines), True)
    if kind == "not_utf8":
        i = rng.randrange(len(lines))
        lines[i] = lines[i][:5] + b"\xff\xfe" + lines[i][5:]
        return Case(target, kind, b"\n".join(lines) + b"\n", True)
    if kind == "not_object":
        lines.insert(rng.randrange(len(lines) + 1), rng.choice([b"[]", b"3", b'"text"', b"true", b"[1, {}]"]))
    elif kind == "huge_line":
        lines.insert(rng.randrange(len(lines) + 1), json.dumps({"kind": "note", "x": "y" * 1_000_000}).encode())
    elif kind == "deep":
        lines.insert(rng.randrange(len(lines) + 1), b"[" * 100_000 + b"]" * 100_000)
    elif kind == "blank_lines":
        lines = [x for line in lines for x in (line, b"", b"   ")]
    elif kind == "crlf":
        return Case(target, kind, b"\r\n".join(lines) + b"\r\n", True)
    elif kind == "null":
        lines.insert(rng.randrange(len(lines) + 1), b"null")
    return Case(target, kind, b"\n".join(lines) + b"\n", True)


def _gatelog(rng: random.Random) -> Case:
    good = [{"kind": "watch", "candidate": "v0002", "baseline": "v0001", "decision": "worse", "rolled_back_to": "v0001",
             "p_value": 0.001, "action": "rolled back", "time": "2026-11-22T02:15:00+00:00"},
            {"candidate": "/ck/v0003", "passed": True, "reason": "ranks rewarded actions better"},
            {"kind": "watch", "candidate": "v0003", "canary": True, "rolled_back_to": "v0001",
             "p_value": rng.choice([0.004, None, "x", True, float("inf")]), "action": "canary stopped"}]
    return _jsonl(rng, good, "gatelog")


def _history(rng: random.Random) -> Case:
    good = [{"run_id": f"2026-11-2{i}T02:15:00+00:00", "outcome": "published", "version": f"v000{i}",
             "published": True, "metric": "ranking_accuracy", "candidate_metric": 0.6, "published_metric": 0.5}
            for i in range(1, 4)]
    if rng.random() < 0.3:
        good[1]["candidate_metric"] = rng.choice(["0.6", [], True])  # a hand edit: skipped, not a crash
    return _jsonl(rng, good, "history")


def _state(rng: random.Random) -> Case:
    good = {"run_id": "2026-11-23T02:15:00+00:00", "run_date": "2026-11-23", "stage": "done", "since": "2026-11-21",
            "resumed": 0, "version": "v0003", "build": ["transitions: 24 rows"], "watch": [], "outcome": "published"}
    kind = rng.choice(["garbage", "truncated", "not_utf8", "top_level", "bad_stage", "no_run_id", "bad_date",
                       "bad_resumed", "bad_version", "bad_lines", "bad_gate", "no_version_to_publish", "deep",
                       "valid", "valid_extra"])
    body = _dump(good)
    if kind == "garbage":
        return Case("state", kind, rng.choice([b"", b"{", b"not json", b"\x00\x01\x02", b"}{"]), False)
    if kind == "truncated":
        return Case("state", kind, body[: rng.randrange(1, len(body) - 1)], False)
    if kind == "not_utf8":
        at = rng.randrange(len(body))
        return Case("state", kind, body[:at] + b"\xff" + body[at:], False)
    if kind == "top_level":
        return Case("state", kind, _dump(rng.choice([[good], None, "done", 3])), False)
    if kind == "deep":
        return Case("state", kind, b"[" * 100_000 + b"]" * 100_000, False)
    s = dict(good)
    if kind == "bad_stage":
        s["stage"] = rng.choice(["bogus", 3, None, "", ["build"]])
    elif kind == "no_run_id":
        s.pop("run_id") if rng.random() < 0.5 else s.update(run_id=rng.choice([None, 5, ""]))
    elif kind == "bad_date":
        s[rng.choice(["run_date", "since"])] = rng.choice(["tomorrow", "2026-02-30", 20261123, ["2026-11-23"]])
    elif kind == "bad_resumed":
        s["resumed"] = rng.choice([-1, "2", True, 1.5, None])
        if s["resumed"] is None:
            s["resumed"] = {}
    elif kind == "bad_version":
        s["version"] = rng.choice(["../../etc", 3, ["v0001"]])
    elif kind == "bad_lines":
        s[rng.choice(["build", "watch", "train", "gate_lines", "publish_lines", "versions"])] = rng.choice(
            ["one line", 3, [1, 2], {"a": 1}])
    elif kind == "bad_gate":
        s["gate"] = rng.choice([[], "passed", 3])
    elif kind == "no_version_to_publish":
        s["stage"] = rng.choice(["gate", "publish"])
        s.pop("version")
    elif kind == "valid_extra":
        s["unknown"] = {"nested": [1, 2, 3]}
        return Case("state", kind, _dump(s), True)
    else:
        return Case("state", "valid", body, True)
    return Case("state", kind, _dump(s), False)


def case_for(seed: int, index: int, endpoint: str) -> Case:
    rng = random.Random(seed * 1_000_003 + index)
    r = rng.random()
    if r < 0.55:
        return _registry(rng, endpoint)
    if r < 0.7:
        return _gatelog(rng)
    if r < 0.9:
        return _state(rng)
    return _history(rng)


# -- the target ------------------------------------------------------------------------------


@dataclass
class Failure:
    case_id: str
    target: str
    kind: str
    command: str
    what: str


@dataclass
class Summary:
    cases: int = 0
    commands: int = 0
    by_target: dict[str, int] = field(default_factory=dict)
    by_kind: dict[str, int] = field(default_factory=dict)
    tracebacks: int = 0  # an exception out of a command, or a traceback printed
    wrong_exit: int = 0  # a broken file not refused with 2, or a valid one refused
    unclear: int = 0  # a refusal that is not one line naming the file
    server_touched: int = 0  # requests to the server while the registry was broken
    file_changed: int = 0  # a broken registry or state file rewritten
    glued: int = 0  # a decision appended after a torn line that did not read back
    refused: int = 0  # refusals seen (exit 2), as they should be
    full_reports: int = 0
    slowest_s: float = 0.0
    slowest: str = ""
    wall_s: float = 0.0
    failures: list[Failure] = field(default_factory=list)


class Target:
    """A checkpoints folder (four version folders, a small transitions dataset), the
    vLLM stand-in, and the log captured so a printed traceback is seen."""

    def __init__(self, root: Path) -> None:
        from transitions_data import row, write

        self.root, self.server = root, Standin()
        self.ck, self.data, self.reports = root / "ck", root / "data", root / "reports"
        for v in ("v0001", "v0002", "v0003", "v0004"):
            fake_adapter(self.ck / v, v)
        from nightshift.trainer.checkpoint import vllm_problems

        vllm_problems(self.ck / "v0001")  # imports torch (safetensors' reader) once, not in the first case timed
        rows = []
        for i in range(12):
            for v in (None, "v0001", "v0002", "v0999"):
                r = row(f"task {i}", "answer", float(i % 2), trajectory=f"{v}-{i}".ljust(32, "0"))
                rows.append({**r, "policy_version": v})
        write(self.data, rows)
        self.config = root / "nightshift.yaml"
        self.config.write_text(json.dumps({
            "data": str(self.data), "transform": {"settle": 0},
            "train": {"base_model": str(root / "no-model"), "served_model_name": "tiny", "output": str(self.ck)},
            "publish": {"vllm_url": self.server.url, "name": NAME, "stable_name": STABLE, "retries": 0,
                        "timeout": 5}}))
        # the CLI's parser, built once: building it costs about 0.6 s (every stage's settings' type hints),
        # which would be most of a case; main(argv) is otherwise what `nightshift` runs
        import nightshift.cli.main as cli

        parser = cli.build_parser()
        self._build_parser, cli.build_parser = cli.build_parser, lambda: parser
        self.log = io.StringIO()
        root_logger = logging.getLogger()
        self._handlers = root_logger.handlers[:]
        handler = logging.StreamHandler(self.log)
        root_logger.handlers = [handler]
        root_logger.setLevel(logging.WARNING)

    def close(self) -> None:
        import nightshift.cli.main as cli

        cli.build_parser = self._build_parser
        logging.getLogger().handlers = self._handlers
        self.server.close()

    def main(self, argv: list[str]) -> tuple[int | None, str, str]:
        """`nightshift <argv>` in process: (exit code, None for an exception; stdout; stderr + log)."""
        from nightshift.cli.main import main

        out, err = io.StringIO(), io.StringIO()
        self.log.seek(0)
        self.log.truncate()
        code: int | None
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except Exception:  # noqa: BLE001 - what the campaign counts
                import traceback

                code = None
                err.write(traceback.format_exc())
        return code, out.getvalue(), err.getvalue() + self.log.getvalue()

    def reset(self) -> None:
        for p in (self.ck / "published.json", self.ck / "gate-log.jsonl"):
            p.unlink(missing_ok=True)
        shutil.rmtree(self.ck / ".nightly", ignore_errors=True)
        shutil.rmtree(self.reports, ignore_errors=True)
        with self.server.lock:
            self.server.adapters.clear()
            self.server.requests.clear()


def _fail(s: Summary, case_id: str, case: Case, command: str, what: str) -> None:
    s.failures.append(Failure(case_id, case.target, case.kind, command, what[-600:]))


def _check(s: Summary, case_id: str, case: Case, command: str, code: int | None, err: str, *, refuse: bool,
           name: str, allowed: tuple[int, ...]) -> None:
    s.commands += 1
    if code is None or TRACEBACK in err:
        s.tracebacks += 1
        return _fail(s, case_id, case, command, f"traceback: {err}")
    if refuse:
        if code != 2:
            s.wrong_exit += 1
            return _fail(s, case_id, case, command, f"exit {code}, expected 2: {err}")
        s.refused += 1
        lines = [x for x in err.splitlines() if x.strip() and "WARNING" not in x]
        if len(lines) != 1 or name not in lines[0]:
            s.unclear += 1
            _fail(s, case_id, case, command, f"refusal not one line naming {name}: {err}")
    elif code not in allowed:
        s.wrong_exit += 1
        _fail(s, case_id, case, command, f"exit {code}, expected one of {allowed}: {err}")


def _registry_case(t: Target, s: Summary, case_id: str, case: Case, full_report: bool) -> None:
    path = t.ck / "published.json"
    path.write_bytes(case.body)
    url = ["--vllm-url", t.server.url, "--name", NAME, "--stable-name", STABLE, "--retries", "0", "--timeout", "5"]
    code, _, err = t.main(["versions", "--data", str(t.data), "--checkpoints", str(t.ck)])
    _check(s, case_id, case, "versions", code, err, refuse=False, name="", allowed=(0,))
    for command, argv, allowed in (
            ("watch --dry-run", ["watch", "--data", str(t.data), "--checkpoints", str(t.ck), *url, "--dry-run"], (0,)),
            ("rollback", ["rollback", "--checkpoints", str(t.ck), *url], (0, 1)),
            ("publish", ["publish", "--checkpoint", str(t.ck / "v0004"), *url], (0, 1))):
        code, _, err = t.main(argv)
        _check(s, case_id, case, command, code, err, refuse=not case.valid, name="published.json", allowed=allowed)
        if not case.valid and t.server.requests:
            s.server_touched += 1
            _fail(s, case_id, case, command, f"the server got {t.server.requests} with a broken registry")
        if not case.valid and path.read_bytes() != case.body:
            s.file_changed += 1
            _fail(s, case_id, case, command, "the broken registry was rewritten")
        t.server.requests.clear()
    _report(t, s, case_id, case, full_report)


def _report(t: Target, s: Summary, case_id: str, case: Case, full: bool) -> None:
    from nightshift.nightly import report

    s.commands += 1
    try:
        if full:
            s.full_reports += 1
            state = {"run_id": "2026-11-23T02:15:00+00:00", "outcome": "published"}
            report.write(state, report.read_history(t.ck / ".nightly" / "runs.jsonl"), str(t.data), t.reports,
                         checkpoints=str(t.ck))
        else:
            report.rolled_back(str(t.ck))
            notes = report.state_notes(str(t.ck))
            report.markdown({"run_id": "r", "notes": notes, "versions": report.versions_lines(str(t.data), str(t.ck))},
                            report.read_history(t.ck / ".nightly" / "runs.jsonl"), "x.png")
    except Exception:  # noqa: BLE001
        import traceback

        s.tracebacks += 1
        _fail(s, case_id, case, "report", traceback.format_exc())


def _gatelog_case(t: Target, s: Summary, case_id: str, case: Case, full_report: bool) -> None:
    from nightshift.judge import gatelog

    (t.ck / "gate-log.jsonl").write_bytes(case.body)
    _report(t, s, case_id, case, full_report)
    marker = {"kind": "watch", "candidate": "v0004", "decision": "better", "case": case_id}
    gatelog.append(t.ck, marker)
    s.commands += 1
    if gatelog.read(t.ck)[0][-1:] != [marker]:
        s.glued += 1
        _fail(s, case_id, case, "gate-log append", "the decision appended after this file did not read back")


def _state_case(t: Target, s: Summary, case_id: str, case: Case, run_nightly: bool) -> None:
    from nightshift.nightly.run import _load

    state = t.ck / ".nightly" / "state.json"
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_bytes(case.body)
    if case.valid and not run_nightly:
        s.commands += 1
        try:
            _load(state.parent)
        except Exception as e:  # noqa: BLE001
            s.wrong_exit += 1
            _fail(s, case_id, case, "nightly state", f"a valid state refused: {e}")
        return
    code, _, err = t.main(["nightly", "--config", str(t.config), "--quiet"])
    _check(s, case_id, case, "nightly", code, err, refuse=not case.valid, name="state.json", allowed=(0, 1))
    if not case.valid:
        if t.server.requests:
            s.server_touched += 1
            _fail(s, case_id, case, "nightly", f"the server got {t.server.requests} with a broken state")
        if state.read_bytes() != case.body:
            s.file_changed += 1
            _fail(s, case_id, case, "nightly", "the broken state was rewritten")


def _history_case(t: Target, s: Summary, case_id: str, case: Case, full_report: bool) -> None:
    path = t.ck / ".nightly" / "runs.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(case.body)
    _report(t, s, case_id, case, full_report)


def run_case(t: Target, s: Summary, seed: int, index: int, full_every: int = 50) -> None:
    case = case_for(seed, index, t.server.url)
    case_id = f"{seed}:{index}"
    t.reset()
    s.cases += 1
    s.by_target[case.target] = s.by_target.get(case.target, 0) + 1
    s.by_kind[f"{case.target}:{case.kind}"] = s.by_kind.get(f"{case.target}:{case.kind}", 0) + 1
    full = index % full_every == 0
    t0 = time.perf_counter()
    {"registry": _registry_case, "gatelog": _gatelog_case, "state": _state_case,
     "history": _history_case}[case.target](t, s, case_id, case, full)
    took = time.perf_counter() - t0
    if took > s.slowest_s:
        s.slowest_s, s.slowest = took, f"{case_id} {case.target}:{case.kind}"


def campaign(cases: int, seed: int = 1, full_every: int = 50, progress: bool = False) -> Summary:
    root = Path(tempfile.mkdtemp(prefix="nightshift-state-fuzz-"))
    s = Summary()
    t0 = time.perf_counter()
    t = Target(root)
    try:
        for i in range(cases):
            run_case(t, s, seed, i, full_every)
            if progress and (i + 1) % 200 == 0:
                print(f"  {i + 1:,} cases, {s.tracebacks} tracebacks, {len(s.failures)} failures", file=sys.stderr)
    finally:
        t.close()
        shutil.rmtree(root, ignore_errors=True)
    s.wall_s = time.perf_counter() - t0
    return s


def ok(s: Summary) -> bool:
    return not s.failures


def report(s: Summary) -> str:
    out = [f"cases: {s.cases:,} ({', '.join(f'{k} {v:,}' for k, v in sorted(s.by_target.items()))}), "
           f"commands run: {s.commands:,}, in {s.wall_s:.0f} s",
           f"tracebacks: {s.tracebacks}; wrong exit codes: {s.wrong_exit}; refusals not one line naming the file: "
           f"{s.unclear}",
           f"broken registry or state: server touched {s.server_touched}, file rewritten {s.file_changed}; "
           f"refusals (exit 2): {s.refused:,}",
           f"decisions appended after a broken gate log that did not read back: {s.glued}",
           f"whole nightly reports written: {s.full_reports}; slowest case {s.slowest_s:.2f} s ({s.slowest})"]
    for f in s.failures[:10]:
        out.append(f"  FAILED {f.case_id} {f.target}:{f.kind} {f.command}: {f.what[:300]}")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--full-every", type=int, default=50, help="a whole nightly report (with its plot) every N cases")
    ap.add_argument("--replay", help="SEED:INDEX of one case: run it alone and print what happened")
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--write-docs", action="store_true", help="put the figures into docs/RELIABILITY.md")
    args = ap.parse_args()
    if args.replay:
        seed, index = (int(x) for x in args.replay.split(":"))
        root = Path(tempfile.mkdtemp(prefix="nightshift-state-fuzz-"))
        t = Target(root)
        try:
            case = case_for(seed, index, t.server.url)
            print(f"{case.target}:{case.kind} ({'valid' if case.valid else 'broken'}), {len(case.body):,} bytes:")
            print(repr(case.body[:600]))
            s = Summary()
            run_case(t, s, seed, index, full_every=1)
        finally:
            t.close()
            shutil.rmtree(root, ignore_errors=True)
        print(report(s))
        return 0 if ok(s) else 1
    s = campaign(args.cases, args.seed, args.full_every, progress=True)
    print("state files campaign (hardening/state_fuzz.py)")
    print(report(s))
    if args.json:
        from dataclasses import asdict

        Path(args.json).write_text(json.dumps(asdict(s), indent=1))
    if args.write_docs:
        import docs

        docs.write_section("state-fuzz", docs.state_fuzz_section(s, args))
    return 0 if ok(s) else 1


if __name__ == "__main__":
    sys.exit(main())
