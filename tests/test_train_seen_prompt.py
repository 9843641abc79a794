"""An answer the route gave under a prompt candidate (`prompt_seen`, issue 27) is
trained on with the prompt the model saw when the nightly names it
(`train.select.seen_prompts`, filled from the prompt candidates), and left out
otherwise: in the agent world an adapter trained only on the agent's own prompt
scored 95 % under it and 0 % under the promoted prompt the route then applied."""

from __future__ import annotations

from transitions_data import row, write

from nightshift.nightly import experiments
from nightshift.publish import prompt_canary as trials
from nightshift.trainer.config import TrainConfig
from nightshift.trainer.select import select, with_system

SEEN = "0123456789ab"


def test_rows_answered_under_a_named_candidate_train_with_its_prompt(tmp_path):
    rows = [row(f"q{i}", f"a{i}", 1.0) for i in range(4)]
    for r in rows:
        r["prompt_seen"] = None
    rows[1]["prompt_seen"], rows[3]["prompt_seen"] = SEEN, "ba9876543210"  # the second: a candidate not named
    write(tmp_path / "data", rows)
    cfg = TrainConfig(data=str(tmp_path / "data"))
    cfg.select.seen_prompts = {SEEN: ["Be brief.", "Use the lookup tool for colours."]}
    sel = select(cfg)
    by_id = {r["transition_id"]: r for r in sel.rows}
    assert sorted(by_id) == sorted(rows[i]["transition_id"] for i in (0, 1, 2))
    assert [n for why, n in sel.excluded.items() if "prompt_seen" in why] == [1]
    seen = by_id[rows[1]["transition_id"]]["input_messages"]
    assert [(m["role"], m["content"]) for m in seen[:2]] == [("system", "Be brief."),
                                                              ("system", "Use the lookup tool for colours.")]
    assert seen[2:] == [m for m in rows[1]["input_messages"] if m["role"] != "system"]
    assert by_id[rows[0]["transition_id"]]["input_messages"] == rows[0]["input_messages"]  # unmarked: as recorded


def test_with_system_replaces_the_leading_system_messages_only():
    msgs = [{"role": "system", "content": "a"}, {"role": "system", "content": "b"}, {"role": "user", "content": "q"},
            {"role": "system", "content": "late"}]
    assert with_system(msgs, "new") == [{"role": "system", "content": "new"}, *msgs[2:]]
    assert with_system([{"role": "user", "content": "q"}], ["s"]) == [{"role": "system", "content": "s"},
                                                                      {"role": "user", "content": "q"}]


def test_the_nightly_names_every_candidate_a_route_tried(tmp_path):
    from nightshift.prompts import store

    store_dir = str(tmp_path / "store")
    man = {"kind": "prompt", "candidate": {"version_id": SEEN, "system": ["Be brief."], "system_hash": "c" * 12}}
    store.commit(store_dir, "solver", {"system.txt": "Be brief."}, man)
    assert experiments.seen_prompts(store_dir) == {}  # never on the route: nothing answered under it
    trials.append(store_dir, {"role": "canary", "agent": "solver", "match": "a" * 12, "candidate": "c" * 12,
                              "version": "v0001"})
    assert experiments.seen_prompts(store_dir) == {SEEN: ["Be brief."]}
