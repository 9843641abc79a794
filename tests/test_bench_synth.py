"""The transform benchmark's synthetic trajectories (benchmarks/synth_traces.py):
the spans schema exactly, the trajectory shape, and the Parquet rows equal to the
plain-dict trajectories Agent Lightning's peer is given."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

from nightshift.schemas import attr
from nightshift.schemas import spans as spans_schema

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "synth_traces.py"


@pytest.fixture(scope="module")
def st():
    spec = importlib.util.spec_from_file_location("synth_traces", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["synth_traces"] = mod
    spec.loader.exec_module(mod)
    mod.TOKEN_POOL_MIN = 1 << 14  # a smaller token pool: same code, faster to make
    return mod


def _small(st, **kw):
    base = dict(spans=8 * 24, calls=5, prompt_chars=60, response_chars=25, prompt_tokens=6, prompt_step=4,
                response_tokens=3, attempts=2, days=2, mix=True, seed=7)
    return st.Params(**{**base, **kw})


def _value(v: dict):
    t = v["type"]
    if t == "array":
        return json.loads(v["json_value"])
    return v[{"string": "string_value", "int": "int_value", "double": "double_value"}[t]]


def test_schema_and_files(st, tmp_path):
    p = _small(st)
    table = st.chunk_table(p, 0, p.trajectories)
    assert table.schema.equals(spans_schema.SCHEMA, check_metadata=True)
    table.validate(full=True)
    rows, size, files = st.write_dataset(p, str(tmp_path), chunk_spans=8 * 5, row_group_spans=16)
    assert rows == p.total_spans == 8 * 24 and size > 0
    paths = sorted(tmp_path.glob("spans/date=*/*.parquet"))
    assert len(paths) == files and {x.parent.name for x in paths} == {"date=2026-11-01", "date=2026-11-02"}
    for f in paths:
        schema = pq.read_schema(f)
        assert schema.equals(spans_schema.SCHEMA) and schema.metadata == spans_schema.SCHEMA.metadata
    assert st.PROMOTED == spans_schema.PROMOTED


def test_rows_equal_the_dict_trajectories(st):
    """Both renderers read one layout table; the vectorized one must not drift."""
    p = _small(st)
    rows = st.chunk_table(p, 0, p.trajectories).to_pylist()
    spt = p.spans_per_trajectory
    seen = set()
    for i in range(p.trajectories):
        for k, d in enumerate(st.trajectory(p, i)):
            r = rows[i * spt + k]
            for col in ("trace_id", "span_id", "parent_span_id", "name", "kind", "status_code", "service_name",
                        "scope_name", "scope_version", *spans_schema.PROMOTED):
                assert r[col] == d[col], (i, k, col)
            assert r["start_time"].timestamp() == pytest.approx(d["start_ns"] / 1e9, abs=1e-6)
            assert r["end_time"].timestamp() == pytest.approx(d["end_ns"] / 1e9, abs=1e-6)
            assert [(a["key"], a["value"]["type"], _value(a["value"])) for a in r["attributes"]] == d["attributes"]
            seen.add(d["convention"])
    assert seen == set(st.CONVENTIONS)  # --mix used every layout


def test_trajectory_shape(st):
    p = _small(st, mix=False)
    df = pl.from_arrow(st.chunk_table(p, 0, p.trajectories))
    assert df.height == p.trajectories * (p.calls + 3)
    assert df["trace_id"].n_unique() == p.trajectories and df["span_id"].n_unique() == df.height
    # promoted columns agree with the attributes they come from
    got = df.select("gen_ai_provider_name", attr("gen_ai.system"), "gen_ai_request_model", attr("gen_ai.request.model"))
    assert got["gen_ai_provider_name"].eq_missing(got["gen_ai.system"]).all()
    assert got["gen_ai_request_model"].eq_missing(got["gen_ai.request.model"]).all()
    for i in range(p.trajectories):
        tr = st.trajectory(p, i)
        names = [s["name"] for s in tr]
        assert names == ["rollout.session", "agent.run", *["openai.chat.completion"] * p.calls, "agentlightning.annotation"]
        root, agent, calls, reward = tr[0], tr[1], tr[2:-1], tr[-1]
        assert root["parent_span_id"] is None and agent["parent_span_id"] == root["span_id"]
        assert all(c["parent_span_id"] == agent["span_id"] for c in calls)
        assert reward["parent_span_id"] == root["span_id"]
        a = dict((k, v) for k, _, v in agent["attributes"])
        assert a == {"agent.name": "writer"}
        r = dict((k, v) for k, _, v in reward["attributes"])
        assert r["agentlightning.reward.0.name"] == "primary" and r["agentlightning.reward.0.value"] in (0.0, 1.0)
        prev = None
        for j, c in enumerate(calls):
            at = {k: v for k, _, v in c["attributes"]}
            types = {k: t for k, t, _ in c["attributes"]}
            assert types["prompt_token_ids"] == "array" and types["gen_ai.usage.prompt_tokens"] == "int"
            assert len(at["prompt_token_ids"]) == at["gen_ai.usage.prompt_tokens"] == p.prompt_tokens + j * p.prompt_step
            assert len(at["response_token_ids"]) == p.response_tokens
            assert len(at["gen_ai.prompt.1.content"]) == p.prompt_chars
            assert at["gen_ai.prompt.0.role"] == "system" and at["llm.request.type"] == "chat"
            if prev is not None:  # the prompt grows: previous prompt, previous response, then new ids
                assert at["prompt_token_ids"][:len(prev[0]) + len(prev[1])] == prev[0] + prev[1]
            prev = (at["prompt_token_ids"], at["response_token_ids"])
            assert root["start_ns"] < c["start_ns"] < c["end_ns"] < root["end_ns"]
    # attempts of one task share their first user message
    first = [dict((k, v) for k, _, v in st.trajectory(p, i)[2]["attributes"])["gen_ai.prompt.1.content"] for i in range(4)]
    assert first[0] == first[1] and first[2] == first[3] and first[0] != first[2]


def test_deterministic(st):
    p = _small(st)
    assert st.chunk_table(p, 3, 9).equals(st.chunk_table(p, 3, 9))
    assert st.trajectory(p, 5) == st.trajectory(p, 5)
    assert st.trajectory(p, 5)[0]["trace_id"] != st.trajectory(_small(st, seed=8), 5)[0]["trace_id"]
