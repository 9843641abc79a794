"""The proposer, over real HTTP on loopback against the stand-in proposer
(tests/support/proposer_standin.py: it answers only from what it is sent), and
against broken ones: what is stored, what is refused and why, that a failing
proposer costs only what failed, that the key is never written, and that the
screening hook gets the weight gate's contract."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nightshift.cli.main import main
from nightshift.prompts import beam, client, store
from nightshift.prompts.config import ApoConfig, ScreenSettings
from nightshift.prompts.meta import MetaError, load as load_meta
from nightshift.judge.screen import screener
from nightshift.prompts.propose import ApoError, propose
from nightshift.schemas import feedback
from support.proposer_standin import Standin
from transitions_data import msg, row, write

T0 = dt.datetime(2026, 11, 20, 8, tzinfo=dt.timezone.utc)
KEY = "sk-test-9f8e7d6c5b4a39281706"
PROMPT = "Use one tool, then reply: The answer is X."
TOOL_ERROR = "error: calculator cannot read a colour question"
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look up today's colour.",
                                           "parameters": {"type": "object", "properties": {}}}},
         {"type": "function", "function": {"name": "calculator", "description": "Compute arithmetic.",
                                           "parameters": {"type": "object", "properties": {}}}}]


def make_lake(data: Path, n: int = 36, prompt: str = PROMPT, start: int = 0) -> None:
    """An agent whose failed runs called the calculator on colour questions (the tool
    said so), some with a user's comment; a judge in the same traces that holds the
    expected answer (which no critic may see)."""
    rows, labels = [], []
    for k in range(start, start + n):
        when = T0 + dt.timedelta(minutes=k)
        tid = f"{k:032x}"
        fail = k % 3 == 0
        tool = "calculator" if fail else "lookup"
        inputs = [msg("system", f"Today is {when:%Y-%m-%d}. {prompt}"), msg("user", "What colour is the lamp today?"),
                  msg("assistant", None, [{"id": "c1", "name": tool, "arguments": "{}"}]),
                  msg("tool", TOOL_ERROR if fail else "result: red", tool_call_id="c1")]
        rows.append(row(inputs, "The answer is zero." if fail else "The answer is red.", None, trajectory=tid,
                        step=0, num_steps=2, agent="solver", tools=TOOLS, when=when))
        rows.append(row([msg("system", "You grade answers."), msg("user", "EXPECTED ANSWER: red")], "graded",
                        0.0 if fail else 1.0, trajectory=tid, step=1, num_steps=2, agent="judge",
                        when=when + dt.timedelta(seconds=5)))
        if fail and k % 2 == 0:
            labels.append({"feedback_id": f"f{k}", "trace_id": tid, "conversation_id": None, "span_id": None,
                           "name": "user_rating", "value": 0.0, "comment": "it never looked the colour up",
                           "time": when, "source": "test", "received_time": when})
    write(data, rows, name=f"part-{start}.parquet")
    if labels:
        d = data / "feedback" / "date=2026-11-20"
        d.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(labels, schema=feedback.SCHEMA), d / f"part-{start}.parquet")


@pytest.fixture
def lake(tmp_path) -> Path:
    make_lake(tmp_path / "data")
    return tmp_path / "data"


def config(data: Path, standin: Standin, **kw) -> ApoConfig:
    cfg = ApoConfig(data=str(data), base_url=standin.url, model="any-model", candidates=2, timeout=5.0, retries=0)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def files_text(root: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in root.rglob("*") if p.is_file() and p.suffix != ".parquet")


def test_a_round_stores_validated_candidates_from_the_failures_only_the_agent_saw(lake, monkeypatch, caplog):
    monkeypatch.setenv("APO_TEST_KEY", KEY)
    caplog.set_level(logging.DEBUG)
    with Standin(key=KEY) as s:
        rnd = propose(config(lake, s, api_key_env="APO_TEST_KEY"), "solver", salt="night-1")
    free, one_fix = rnd.stored  # edit.md, then edit_conservative.md: it fixes the most frequent problem only
    assert [a.edit_prompt for a in rnd.attempts] == ["edit.md", "edit_conservative.md"]
    m = free.manifest
    assert m["parent"]["version_id"] == rnd.current.id and m["parent"]["rated"] == 36
    for cand in (free, one_fix):
        assert cand.system.startswith("Today is {{date}}. " + PROMPT)  # the slot kept
        assert TOOL_ERROR in cand.system  # derived from what the lake said (12 of 12 failures)
    assert "it never looked the colour up" in free.system and "it never looked" not in one_fix.system
    assert TOOL_ERROR in m["critique"] and m["critique"] == one_fix.manifest["critique"]
    cand = free
    read = m["trajectories"]
    assert [t["failed"] for t in read] == [True] * 8 + [False] * 4  # failures first
    assert m["trajectories_available"] == {"failed": 12, "succeeded": 24}
    assert m["proposer"]["model"] == "any-model" and m["proposer"]["answered_as"] == "standin-proposer"
    assert m["proposer"]["api_key_env"] == "APO_TEST_KEY"
    assert m["meta_prompts"]["critique.md"]["sha256"] == load_meta().critique.sha256
    folder = Path(cand.path)
    assert (folder / "system.txt").read_text() == cand.system
    assert json.loads((folder / "parent" / "prompt.json").read_text())["version_id"] == rnd.current.id
    # what went over the wire: the key as a Bearer token, no trace context, and only this agent's calls
    assert all(r["headers"]["authorization"] == f"Bearer {KEY}" for r in s.requests)
    assert not any(k in r["headers"] for r in s.requests for k in ("traceparent", "tracestate", "baggage"))
    sent = json.dumps([r["body"] for r in s.requests])
    assert "it never looked the colour up" in sent and "EXPECTED ANSWER" not in sent
    # the key is in no file and no log line
    assert KEY not in files_text(lake.parent) and KEY not in caplog.text
    assert json.loads((lake / "prompt-candidates" / "solver" / "beam.json").read_text())["base"] == rnd.current.id


BROKEN = [
    # (script of the stand-in's modes, the reason recorded, candidates stored of 2)
    (["ok", "garbage", "ok"], "answered something that is not JSON", 1),
    (["ok", "not_completion", "ok"], "not a chat completion", 1),
    (["ok", "empty", "ok"], "answered with no text", 1),
    (["ok", "enormous", "ok"], "more than apo.max_prompt_chars", 1),
    (["ok", "unchanged", "ok"], "its parent unchanged", 1),
    (["ok", "drop_placeholder", "ok"], "drops the placeholder(s) {{date}}", 1),
    (["ok", "no_block", "ok"], "holds no <prompt>", 1),
    (["ok", "slow", "ok"], "did not answer within 0.5 s", 1),
    (["500"], "answered HTTP 500", 0),
    (["slow"], "did not answer within 0.5 s", 0),
]


@pytest.mark.parametrize("script,reason,stored", BROKEN, ids=[b[1][:24] for b in BROKEN])
def test_a_broken_proposer_costs_only_what_it_broke(lake, script, reason, stored):
    with Standin(script=script, delay=1.5) as s:
        rnd = propose(config(lake, s, timeout=0.5), "solver", salt="night-1")
    assert len(rnd.stored) == stored
    said = [a.rejected for a in rnd.attempts] + rnd.notes
    assert any(reason in r for r in said), said
    assert len(store.candidates(str(lake / "prompt-candidates"), "solver")) == stored


def test_retries_wait_then_give_up_with_one_sentence(lake, monkeypatch):
    waits = []
    monkeypatch.setattr(client, "time", type("T", (), {"sleep": staticmethod(waits.append)}))
    with Standin(mode="500") as s:
        rnd = propose(config(lake, s, retries=2), "solver", salt="n")
    assert len(s.requests) == 3 and waits == [1.0, 2.0]
    assert rnd.notes[-1].endswith("answered HTTP 500: {\"error\": {\"message\": \"internal error\"}} (after 3 tries)")


def test_cli_refuses_without_a_proposer_or_its_key_and_never_repeats_a_key(lake, monkeypatch, capsys):
    args = ["prompts", "propose", "--data", str(lake), "--agent", "solver"]
    assert main(args) == 2
    assert "no proposer: set apo.base_url" in capsys.readouterr().err
    with Standin(key="the-right-one") as s:
        url = ["--base-url", s.url, "--model", "m", "--retries", "0"]
        assert main(args + url + ["--api-key-env", "APO_UNSET_KEY"]) == 2
        assert "apo.api_key_env names APO_UNSET_KEY, which is not set" in capsys.readouterr().err
        assert main(args[:-1] + ["nobody"] + url) == 2
        assert "no agent named 'nobody'" in capsys.readouterr().err
        monkeypatch.setenv("APO_TEST_KEY", KEY)
        assert main(args + url + ["--api-key-env", "APO_TEST_KEY"]) == 1  # 401: the critique failed, nothing stored
    out = capsys.readouterr()
    assert "answered HTTP 401" in out.out and KEY not in out.out + out.err
    assert s.requests and KEY in s.requests[-1]["headers"]["authorization"]  # it was sent, only to the API
    assert KEY not in files_text(lake.parent)


def test_when_the_agent_changes_its_own_prompt_the_beam_starts_again(lake):
    with Standin() as s:
        cfg = config(lake, s, gate=ScreenSettings(command="true"))
        first = propose(cfg, "solver", salt="n", screen=screener(cfg))
        assert [e.ref for e in first.beam.entries] == ["lake", "v0002"]  # passed, unscored: the newest
        make_lake(lake, n=12, prompt="Use the lookup tool for colours, then reply: The answer is X.", start=100)
        rnd = propose(config(lake, s), "solver", salt="n")
    assert rnd.current.id != first.current.id
    assert f"the agent's own prompt changed ({first.current.id} -> {rnd.current.id}): the beam starts again from it" \
        in rnd.notes
    assert list(rnd.critiques) == ["lake"] and rnd.beam.base == rnd.current.id
    assert all(c.manifest["parent"]["version_id"] == rnd.current.id for c in rnd.stored)
    (lake / "prompt-candidates" / "solver" / "beam.json").write_text("{not json")
    with Standin() as s:
        rnd = propose(config(lake, s), "solver", salt="n")
    assert any("beam.json is unreadable" in n for n in rnd.notes)


def test_meta_prompts_are_files_a_user_overrides_and_a_bad_one_is_refused_by_name(lake, tmp_path, capsys):
    mine = tmp_path / "meta"
    mine.mkdir()
    (mine / "critique.md").write_text("OUR OWN CRITIQUE FORMAT.\n<prompt>\n{{prompt}}\n</prompt>\n"
                                      "<trajectories>\n{{trajectories}}\n</trajectories>\n")
    with Standin() as s:
        rnd = propose(config(lake, s, meta_prompts=str(mine)), "solver", salt="n")
    assert s.requests[0]["body"]["messages"][0]["content"].startswith("OUR OWN CRITIQUE FORMAT.")
    assert rnd.stored[0].manifest["meta_prompts"]["critique.md"]["path"] == str(mine / "critique.md")
    (mine / "edit_terse.md").write_text("Fix it: {{prompt}} {{critique}} {{tone}}")
    with pytest.raises(MetaError, match=r"edit_terse.md uses \{\{tone\}\}, which nothing fills"):
        load_meta(str(mine))
    assert main(["prompts", "meta", "--meta-prompts", str(mine)]) == 2
    assert "edit_terse.md uses {{tone}}" in capsys.readouterr().err
    (mine / "edit_terse.md").write_text("Fix it: {{prompt}}")
    with pytest.raises(MetaError, match=r"leaves out \{\{critique\}\}"):
        load_meta(str(mine))


def test_an_agent_without_failures_or_rewards_gets_no_round(tmp_path):
    rows = [row([msg("system", "Be brief."), msg("user", "hi")], "hello", 1.0, agent="happy",
                when=T0 + dt.timedelta(minutes=k), trajectory=f"h{k:031d}") for k in range(5)]
    write(tmp_path, rows)
    with Standin() as s:
        rnd = propose(config(tmp_path, s), "happy", salt="n")
        assert not rnd.stored and not s.requests
        assert rnd.notes == [f"parent lake ({rnd.current.id}): no failed trajectories: nothing to critique"]
        with pytest.raises(ApoError, match="no agent named 'sad'"):
            propose(config(tmp_path, s), "sad")


def test_candidates_commit_atomically_one_version_each(tmp_path):
    root = str(tmp_path / "store")
    out: list = []

    def one(i: int) -> None:
        out.append(store.commit(root, "a/b agent", {"system.txt": f"p{i}"}, {"candidate": {"system": f"p{i}",
                                                                                        "version_id": str(i)}}))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(c.version for c in out) == [f"v{i:04d}" for i in range(1, 7)]
    agent = Path(store.agent_root(root, "a/b agent"))
    assert agent.name.startswith("a_b_agent-")  # a user's agent name is never a path
    (agent / "v0009").mkdir()  # a folder without a manifest is no version
    dead = agent / ".tmp-999999999-deadbeef"
    dead.mkdir()
    assert [c.version for c in store.candidates(root, "a/b agent")] == [f"v{i:04d}" for i in range(1, 7)]
    assert store.clean_stale(root, "a/b agent") == 1 and not dead.exists()
    c = store.candidates(root, "a/b agent")[0]
    before = (Path(c.path) / "manifest.json").read_bytes()
    store.write_screen(c, {"passed": True})
    assert store.read(str(agent), c.version).screen == {"passed": True}
    assert (Path(c.path) / "manifest.json").read_bytes() == before
    assert json.loads(before)["files"]["system.txt"]  # each file's hash, in the manifest


def test_os_environ_is_not_where_the_manifest_records_the_key(monkeypatch):
    """The record of the proposer keeps the variable's name and a URL without credentials."""
    monkeypatch.setenv("APO_TEST_KEY", KEY)
    ep = client.Endpoint("https://user:pw@api.example.com/v1?api-key=" + KEY, "m", "APO_TEST_KEY")
    rec = json.dumps(ep.record())
    assert KEY not in rec and "pw" not in rec and "api.example.com/v1" in rec
    assert os.environ["APO_TEST_KEY"] == KEY


def test_a_prompt_two_agents_send_is_improved_from_one_agents_runs_and_the_other_is_named(lake):
    twin = [row([msg("system", f"Today is {T0:%Y-%m-%d}. {PROMPT}"), msg("user", "EXPECTED ANSWER of the twin")],
                "ok", 1.0, agent="twin", trajectory=f"t{k:031d}", tools=TOOLS, when=T0 + dt.timedelta(minutes=k))
            for k in range(3)]
    write(lake, twin, name="twin.parquet")
    with Standin() as s:
        rnd = propose(config(lake, s), "solver", salt="n")
        sent = json.dumps([r["body"] for r in s.requests])
    assert rnd.current.shared_with == ["twin"] and rnd.stored
    assert any("agent(s) twin send the same prompt" in n for n in rnd.notes)
    assert "EXPECTED ANSWER of the twin" not in sent  # only the solver's own conversations were read
