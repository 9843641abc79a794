"""Attribution (issue 27, item 5): a call whose answer the route marked (`+p:<id>` on
the response's model) becomes a transition whose `prompt_seen` is that id, its model
names as served, and `nightshift prompts` counts it for the prompt the model saw."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from nightshift.prompts.versions import by_agent
from nightshift.schemas.prompt_identity import PromptVersion
from nightshift.transform.attribution import unmark
from nightshift.transform.build import build
from nightshift.transform.config import TransformConfig
from traces import Trace, genai_call, write_spans

AGENT = "You answer questions about orders."
CANDIDATE = "You answer questions about orders. Look the order up first."
VID = PromptVersion.of([CANDIDATE], []).id


def test_unmark_takes_only_the_routes_mark():
    assert unmark(f"agent@v0004+p:{VID}") == ("agent@v0004", VID)
    assert unmark("gpt-4o+p:notanid") == ("gpt-4o+p:notanid", None)
    assert unmark(None) == (None, None)


def _world(data: Path, n: int) -> None:
    """`n` trajectories of one agent, each one call rewarded 1 on the candidate arm and
    0 on the agent's own prompt, every other one on the candidate (marked)."""
    traces = []
    for k in range(n):
        t = Trace(seed=f"t{k}")
        marked = k % 2 == 0
        a = genai_call(f"order {k}?", "It ships today.", model="agent@v0004",
                       history=[{"role": "system", "parts": [{"type": "text", "content": AGENT}]}])
        if marked:
            a["gen_ai.response.model"] = f"agent@v0004+p:{VID}"
        root = t.span("invoke_agent support", {"gen_ai.agent.name": "support", "gen_ai.operation.name": "invoke_agent"})
        t.span("chat agent@v0004", a, parent=root, start=0.1, end=0.5)
        t.span("agentlightning.reward", {"reward": 1.0 if marked else 0.0}, parent=root, start=0.6, end=0.7)
        traces.append(t)
    write_spans(str(data), traces)


def test_marked_calls_carry_the_prompt_the_model_saw_and_are_counted_for_it(tmp_path):
    _world(tmp_path, 8)
    build(TransformConfig(data=str(tmp_path), settle=0))
    df = pl.read_parquet(str(tmp_path / "transitions" / "**" / "*.parquet"))
    assert df.height == 8
    marked = df.filter(pl.col("prompt_seen").is_not_null())
    assert marked.height == 4 and set(marked["prompt_seen"]) == {VID}
    assert set(df["response_model"]) == {"agent@v0004"} and set(df["policy_version"]) == {"v0004"}
    table = by_agent(str(tmp_path), names=False, min_trajectories=1)
    support = table.agent("support")
    got = {v.id: (v.calls, v.trajectories, v.mean) for v in support.versions}
    own = PromptVersion.of([AGENT], []).id
    assert got == {own: (4, 4, 0.0), VID: (4, 4, 1.0)}
    assert support.current.id == own  # what the agent itself sends
    with_text = by_agent(str(tmp_path), names=False, candidates={VID: PromptVersion.of([CANDIDATE], [])})
    assert with_text.agent("support").get(VID).version.text == CANDIDATE


def test_an_older_partition_read_first_does_not_hide_the_column(tmp_path):
    """Polars takes a scan's columns from its first file: a version 2 partition of an
    earlier date would have hidden `prompt_seen` from every later one."""
    import pyarrow.parquet as pq

    _world(tmp_path, 4)
    build(TransformConfig(data=str(tmp_path), settle=0))
    (f,) = (tmp_path / "transitions").glob("date=*/*.parquet")
    old = pq.read_table(f).drop(["prompt_seen"])
    old = old.replace_schema_metadata({**old.schema.metadata, b"nightshift.schema_version": b"2"})
    (tmp_path / "transitions" / "date=2000-01-01").mkdir()
    pq.write_table(old.set_column(old.schema.get_field_index("transition_id"), "transition_id",
                                  pl.Series([f"{i:032x}" for i in range(old.num_rows)]).to_arrow()),
                   tmp_path / "transitions" / "date=2000-01-01" / f.name)
    got = {v.id: v.calls for v in by_agent(str(tmp_path), names=False).agent("support").versions}
    assert got == {PromptVersion.of([AGENT], []).id: 2 + 4, VID: 2}
