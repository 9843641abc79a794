"""What each algorithm is given: sft's best rows (threshold, top-k per group), kto's
labels and shuffling, dpo's same-prompt pairs (highest against lowest, within a
group, at least the margin apart). Rendered tokens are stand-ins: the builders
only compare them."""

from __future__ import annotations

import pytest

from nightshift.trainer.config import TrainConfig
from nightshift.trainer.algorithms.dpo import examples as dpo_examples
from nightshift.trainer.algorithms.kto import examples as kto_examples
from nightshift.trainer.algorithms.sft import examples as sft_examples
from nightshift.trainer.examples import Example
from nightshift.trainer.render import Rendered
from nightshift.trainer.select import Selection, TrainDataError

from transitions_data import row


def ex(prompt: str, answer: str, reward: float, group: str | None = None) -> Example:
    r = row(prompt, answer, reward, group=group)
    ids = [hash(prompt) % 1000]  # the same prompt renders to the same tokens
    return Example(r, Rendered(prompt_ids=ids, completion_ids=[hash(answer) % 1000 + 1]))


def cfg(**kw) -> TrainConfig:
    c = TrainConfig()
    for k, v in kw.items():
        section, _, name = k.partition("__")
        setattr(getattr(c, section), name, v) if name else setattr(c, k, v)
    return c


def test_sft_keeps_rows_at_or_above_the_threshold():
    rows = [ex("q1", "a", 1.0), ex("q1", "b", 0.5), ex("q2", "c", 0.49), ex("q3", "d", -1.0)]
    kept, left = sft_examples(cfg(sft__threshold=0.5), rows)
    assert len(kept) == 2
    assert sum(left.values()) == 2 and "reward below sft.threshold (0.5)" in left


def test_sft_top_k_keeps_the_best_of_each_group():
    rows = [ex("q1", a, r, group="g1") for a, r in (("a", 0.9), ("b", 0.7), ("c", 0.8))]
    rows += [ex("q2", "d", 0.6, group="g2")]
    kept, left = sft_examples(cfg(sft__threshold=0.0, sft__top_k=1), rows)
    completions = sorted(k["input_ids"][-1] for k in kept)
    best = sorted([rows[0].r.completion_ids[0], rows[3].r.completion_ids[0]])
    assert completions == best  # 0.9 from g1, 0.6 from g2
    assert left["beyond the top 1 of their group"] == 2
    assert all(k["completion_start"] == 1 for k in kept)  # loss on the completion only


def test_kto_labels_by_threshold_and_shuffles():
    rows = [ex(f"q{i}", "a", 1.0 if i < 20 else 0.0) for i in range(40)]  # sorted: desirable first
    out, _ = kto_examples(cfg(kto__threshold=0.5, seed=3), rows)
    labels = [r["label"] for r in out]
    assert sum(labels) == 20
    assert labels != sorted(labels, reverse=True)  # not in the input's order
    assert out == kto_examples(cfg(kto__threshold=0.5, seed=3), rows)[0]  # the seed decides


def test_kto_refuses_one_sided_labels_and_a_batch_of_one():
    with pytest.raises(TrainDataError, match="desirable and undesirable"):
        kto_examples(cfg(kto__threshold=0.5), [ex("q", "a", 1.0), ex("p", "b", 0.9)])
    from nightshift.settings import SettingsError

    c = cfg(algorithm="kto", batch_size=1, base_model="tiny")
    with pytest.raises(SettingsError, match="batch_size >= 2"):
        c.check()


def test_dpo_pairs_highest_against_lowest_of_the_same_prompt_within_a_group():
    rows = [ex("q1", "best", 1.0, "g"), ex("q1", "mid", 0.5, "g"), ex("q1", "worst", 0.0, "g"),
            ex("q1", "other group", -5.0, "h"),  # same prompt, another group: never paired with g's
            ex("q2", "close", 0.55, "g"), ex("q2", "closer", 0.5, "g"),  # within the margin
            ex("q3", "alone", 1.0, "g")]
    pairs, left = dpo_examples(cfg(dpo__min_margin=0.2), rows)
    assert len(pairs) == 1
    (p,) = pairs
    assert p["chosen"][0]["content"] == "best" and p["rejected"][0]["content"] == "worst"
    assert p["prompt"][-1]["content"] == "q1"
    assert left["answers beside the chosen and rejected of their prompt"] == 1
    assert left["answers to one prompt within dpo.min_margin (0.2)"] == 2
    assert left["no other answer to the same prompt"] == 2  # q3, and q1 in group h


def test_content_hash_sees_the_messages_not_only_the_ids():
    a = row("q", "a", 1.0, trajectory="t" * 32)
    b = dict(a, output_message={**a["output_message"], "content": "changed"})
    assert Selection([a]).content_hash() != Selection([b]).content_hash()
    assert Selection([a]).content_hash() == Selection([dict(a)]).content_hash()


def test_agents_are_selected_by_exact_name_or_a_whole_name_regex():
    import polars as pl

    from nightshift.trainer.select import agent_filter

    df = pl.DataFrame({"agent_name": ["writer", "rewriter", "checker", None]})

    def chosen(spec):
        return df.filter(agent_filter(spec))["agent_name"].to_list()

    assert chosen("writer") == ["writer"]  # not rewriter: a name is not a substring
    assert chosen("writer,rewriter") == ["writer", "rewriter"]
    assert chosen(["checker"]) == ["checker"]
    assert chosen("writer|check.*") == ["writer", "checker"]
    assert chosen("re:.*writer") == ["writer", "rewriter"]


def test_each_module_of_algorithms_is_an_algorithm_found_by_name_with_its_settings_section():
    """Adding an algorithm is one file: the registry, the settings section and the
    `--algorithm` choice all come from the modules in trainer/algorithms/."""
    import dataclasses
    from pathlib import Path

    from nightshift.trainer import algorithms

    folder = Path(algorithms.__file__).parent
    modules = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    reg = algorithms.registry()
    assert set(reg) == modules == {"sft", "awr", "pg", "kto", "dpo"}
    assert list(reg) == ["pg", "awr", "sft", "kto", "dpo"]  # --algorithm's order, as before
    sections = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for name, algo in reg.items():
        assert algo.name == name and isinstance(getattr(TrainConfig(), name), algo.settings)
        assert sections[name].metadata["help"] == f"the {name} objective"
    assert [a for a in reg if reg[a].needs_advantage] == ["pg", "awr"]
    assert [a for a in reg if not reg[a].shared_loop] == ["kto", "dpo"]
    with pytest.raises(ValueError, match="no algorithm 'grpo': one of pg, awr, sft, kto, dpo"):
        algorithms.get("grpo")


def test_reading_the_train_settings_loads_neither_torch_nor_polars():
    """Every stage's CLI and the collector read TrainConfig; the algorithms' modules
    it is built from import their heavy parts inside functions."""
    import subprocess
    import sys

    code = ("import sys, nightshift.trainer.config as c; c.TrainConfig(); "
            "print(sorted(m for m in ('torch', 'polars', 'transformers', 'trl') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]


def test_kto_by_tokens_picks_its_own_rows_per_step():
    cfg(algorithm="kto", batch_size=0, base_model="tiny").check()  # 0: by tokens, at least 2 rows a batch


def test_calls_answered_under_a_route_prompt_trial_are_left_out_and_counted(tmp_path):
    """A call whose answer the route marked (`prompt_seen`, issue 27) was answered to
    a candidate system prompt, not the one in its input_messages: training on the row
    as recorded teaches the answer to a state the model never had."""
    from transitions_data import row, write

    from nightshift.trainer.config import TrainConfig
    from nightshift.trainer.select import select

    rows = [row(f"q{i}", f"a{i}", 1.0) for i in range(5)]
    for r in rows:
        r["prompt_seen"] = None
    rows[1]["prompt_seen"] = rows[3]["prompt_seen"] = "0123456789ab"
    write(tmp_path / "data", rows)
    sel = select(TrainConfig(data=str(tmp_path / "data")))
    assert sorted(r["transition_id"] for r in sel.rows) == sorted(rows[i]["transition_id"] for i in (0, 2, 4))
    assert [n for why, n in sel.excluded.items() if "prompt_seen" in why] == [2]
