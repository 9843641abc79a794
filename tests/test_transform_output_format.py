"""How the transitions are written (transform/output.py `WRITER`): a dictionary only
on columns whose values repeat, no min/max on text and id lists, and a file every
reader reads the same."""

from __future__ import annotations

import glob

import polars as pl
import pyarrow.parquet as pq
from traces import Trace, genai_call, write_spans

from nightshift.transform.build import build
from nightshift.transform.config import TransformConfig


def _episode(seed: str) -> Trace:
    t = Trace(seed)
    root = t.span("invoke_agent solver", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "solver"},
                  start=0, end=9)
    for i in range(3):
        attrs = {**genai_call(f"task {seed} step {i}", f"answer {i}"), "prompt_token_ids": list(range(i, i + 50)),
                 "response_token_ids": [7, 8, 9]}
        t.span("chat m1", attrs, parent=root, start=1 + 2 * i, end=2 + 2 * i)
    t.span("agentlightning.annotation", {"agentlightning.reward.0.name": "primary",
                                         "agentlightning.reward.0.value": 1.0}, parent=root, start=8, end=8.5)
    return t


def test_transitions_keep_dictionaries_and_statistics_where_they_pay(tmp_path):
    write_spans(tmp_path, [_episode(f"e{i}") for i in range(4)])
    build(TransformConfig(data=str(tmp_path), settle=0))
    [path] = glob.glob(f"{tmp_path}/transitions/date=*/*.parquet")
    md = pq.ParquetFile(path).metadata
    cols = {md.row_group(0).column(i).path_in_schema: md.row_group(0).column(i) for i in range(md.num_columns)}
    for name in ("prompt_token_ids.list.element", "completion_token_ids.list.element",
                 "input_messages.list.element.content", "output_message.content", "transition_id"):
        assert "RLE_DICTIONARY" not in cols[name].encodings, name  # values that do not repeat
    for name in ("prompt_token_ids.list.element", "input_messages.list.element.content"):
        assert not cols[name].is_stats_set, name  # no reader filters on a prompt's min and max
    for name in ("model", "agent_name", "trace_id", "step"):
        assert "RLE_DICTIONARY" in cols[name].encodings, name  # values that repeat
    assert cols["transition_id"].is_stats_set and cols["start_time"].is_stats_set  # what readers filter on
    assert all(c.compression == "ZSTD" for c in cols.values())
    a, b = pl.read_parquet(path), pl.from_arrow(pq.read_table(path))
    assert a.equals(b) and a.height == 12
    assert a["prompt_token_ids"].to_list()[:3] == [list(range(i, i + 50)) for i in range(3)]
