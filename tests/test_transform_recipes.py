"""The transitions recipes of docs/transform.md (the README's until issue 26 moved the
reference there), run as written: Polars queries and Hugging Face `datasets` loading the files."""

from __future__ import annotations

import os
import re
from pathlib import Path

import polars as pl

from test_transform_build import episode, run, _feedback
from traces import T0, write_spans

README = Path(__file__).parent.parent / "docs" / "transform.md"


def _snippets(after: str) -> list[str]:
    text = README.read_text()
    text = text[text.index(after):]
    return re.findall(r"```python\n(.*?)```", text, re.S)[:2]


def test_readme_recipes_run(tmp_path, monkeypatch):
    a, b = episode("ra", 1.0, agent="writer"), episode("rb", 0.0, agent="checker")
    write_spans(tmp_path / "nightshift-data", [a, b])
    _feedback(tmp_path / "nightshift-data", [{"feedback_id": "x", "trace_id": a.hex, "name": "primary", "value": 1.0,
                                              "comment": "good", "received_time": T0 + 1, "source": "http"}])
    run(tmp_path / "nightshift-data")
    monkeypatch.chdir(tmp_path)
    polars_code, hf_code = _snippets("# Transitions: `nightshift build`")
    # Each expression statement's value is collected so we can check what it returns.
    results = []
    ns: dict = {}
    for stmt in re.split(r"\n(?=\S)", polars_code.replace("\\\n", "")):
        stmt = stmt.strip()
        if not stmt or stmt.startswith("#"):
            continue
        lines = [ln for ln in stmt.splitlines() if not ln.startswith("#")]
        code = "\n".join(lines)
        if code.startswith(("import", "from", "tr =", "fb =")):
            exec(code, ns)
        else:
            results.append(eval(code, ns))
    by_agent, messages, per_agent, in_order, joined = results
    assert sorted(by_agent["agent_name"].to_list()) == ["checker", "writer"]
    assert set(messages["role"]) == {"user"} and messages.height == 6
    assert sorted(zip(per_agent["agent_name"], per_agent["calls"], per_agent["reward"])) == [
        ("checker", 3, 0.0), ("writer", 3, 1.0)]
    assert sorted(in_order["agents_in_order"].to_list()) == [["checker"] * 3, ["writer"] * 3]
    assert joined.height == 3 and set(joined["comment"]) == {"good"}
    exec(hf_code, ns)
    ds = ns["ds"]
    assert ds.num_rows == 6 and "input_messages" in ds.column_names
    assert ds[0]["input_messages"][0]["role"] == "user"
