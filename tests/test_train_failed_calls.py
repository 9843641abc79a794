"""A call that failed part way is not trained on (finish reason `error`, the GenAI
conventions' value for a failed call whose partial output was kept)."""

from __future__ import annotations

from transitions_data import row, write

from nightshift.trainer.config import TrainConfig
from nightshift.trainer.select import select


def test_a_failed_calls_partial_answer_is_left_out_and_counted(tmp_path):
    rows = [row(f"q{i}", f"a{i}", 1.0) for i in range(4)]
    for r, finish in zip(rows, ["stop", "error", "length", None]):
        r["finish_reason"] = finish
    write(tmp_path / "data", rows)
    sel = select(TrainConfig(data=str(tmp_path / "data")))
    kept = sorted(r["transition_id"] for r in sel.rows)
    assert kept == sorted(rows[i]["transition_id"] for i in (0, 2, 3))
    assert [n for why, n in sel.excluded.items() if "finish_reason error" in why] == [1]
