"""`nightshift export`: transitions built from recorded real runs, written as chat
examples, read back the ways users read them (Hugging Face `datasets`, TRL's own
chat-template step, Polars), and rendered to the same tokens the trainer renders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest

from nightshift.cli.main import main
from nightshift.trainer import render
from nightshift.trainer.tiny import build_tokenizer
from nightshift.transform.build import build
from nightshift.transform.config import RewardConfig, TransformConfig

DOCTOR = Path(__file__).parent / "fixtures" / "doctor"
FRAMEWORKS = Path(__file__).parent / "fixtures" / "frameworks"
TOOL_ARGUMENTS = {"city": "Paris", "unit": "celsius"}  # what the stub's model called get_weather with


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, pl.DataFrame]:
    """The episode_reward recording (a tool loop and three agents, instrumented by
    openai-v2 2.4b0, rewards on the root spans) built into transitions."""
    data = tmp_path_factory.mktemp("export") / "data"
    shutil.copytree(DOCTOR / "episode_reward" / "spans", data / "spans")
    build(TransformConfig(data=str(data), settle=0, reward=RewardConfig(keys=["episode.reward"])))
    rows = pl.read_parquet(str(data / "transitions" / "**" / "*.parquet"), hive_partitioning=True)
    assert rows.height == 5
    return data, rows


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def run(*args: str) -> int:
    return main(["export", *args])


def by_id(examples: list[dict]) -> dict[str, dict]:
    return {e["transition_id"]: e for e in examples}


@pytest.mark.parametrize("suffix", ["parquet", "jsonl"])
def test_messages_load_back_exactly_and_render_as_the_trainer_does(built, tokenizer, tmp_path, capsys, suffix):
    import datasets

    data, rows = built
    out = tmp_path / f"sft.{suffix}"
    assert run("--data", str(data), "--to", str(out)) == 0
    assert capsys.readouterr().out.startswith(f"exported 5 of 5 transitions to {out} (messages, arguments as object)")
    ds = datasets.load_dataset("parquet" if suffix == "parquet" else "json", data_files=str(out), split="train")
    got = by_id(list(ds))
    assert len(got) == 5
    for row in rows.iter_rows(named=True):
        ex = got[row["transition_id"]]
        prompt, completion, tools = render.conversation(row)
        assert ex["messages"] == prompt + [completion]  # exactly: no key added, none null-filled
        assert ex["tools"] == tools
        assert (ex["agent_name"], ex["step"], ex["reward"], ex["advantage"]) == (
            row["agent_name"], row["step"], row["reward"], row["advantage"])
        # the chat template renders the exported example to the trainer's tokens
        r = render.render(tokenizer, row)
        ids = tokenizer.apply_chat_template(ex["messages"], tools=ex["tools"], tokenize=True, return_dict=True)
        assert list(ids["input_ids"]) == r.prompt_ids + r.completion_ids


def test_tool_calls_are_nested_and_the_tool_result_answers_them(tokenizer, tmp_path):
    """A recorded pydantic-ai run (its built-in instrumentation records the tools
    offered): the exported tool call is the one the model made, nested, and the next
    call's tool result answers its id."""
    case = FRAMEWORKS / "pydantic_ai" / "builtin" / "tool"
    stub = json.loads((case / "stub_calls.json").read_text())
    data = tmp_path / "data"
    shutil.copytree(case / "spans", data / "spans")
    build(TransformConfig(data=str(data), settle=0))
    out = tmp_path / "sft.jsonl"
    assert run("--data", str(data), "--to", str(out)) == 0
    first, second = sorted((json.loads(x) for x in out.read_text().splitlines()), key=lambda e: e["step"])
    (made,) = stub[0]["response"]["choices"][0]["message"]["tool_calls"]
    (call,) = first["messages"][-1]["tool_calls"]
    assert call == {"id": made["id"], "type": "function",
                    "function": {"name": made["function"]["name"], "arguments": json.loads(made["function"]["arguments"])}}
    assert [m["role"] for m in second["messages"]] == [m["role"] for m in stub[1]["request"]["messages"]] + ["assistant"]
    assert second["messages"][2]["tool_calls"] == [call] and second["messages"][3]["tool_call_id"] == call["id"]
    offered = stub[0]["request"]["tools"]
    assert [(t["type"], t["function"]["name"]) for t in first["tools"]] == [(t["type"], t["function"]["name"]) for t in offered]
    rows = pl.read_parquet(str(data / "transitions" / "**" / "*.parquet"))
    for ex in (first, second):
        row = rows.filter(pl.col("transition_id") == ex["transition_id"]).row(0, named=True)
        r = render.render(tokenizer, row)
        ids = tokenizer.apply_chat_template(ex["messages"], tools=ex["tools"], tokenize=True, return_dict=True)
        assert list(ids["input_ids"]) == r.prompt_ids + r.completion_ids


def test_prompt_completion_for_trl_with_text_arguments(built, tokenizer, tmp_path):
    """TRL's own chat-template step takes the prompt-completion examples as they
    load; --arguments text gives OpenAI's files the JSON text instead."""
    import datasets
    from trl.data_utils import maybe_apply_chat_template

    data, rows = built
    out = tmp_path / "pc.parquet"
    assert run("--data", str(data), "--to", str(out), "--format", "prompt_completion") == 0
    ds = datasets.load_dataset("parquet", data_files=str(out), split="train")
    assert set(ds.column_names) >= {"prompt", "completion", "tools", "reward", "advantage", "weight"}
    for ex in ds:
        row = rows.filter(pl.col("transition_id") == ex["transition_id"]).row(0, named=True)
        assert [m["role"] for m in ex["completion"]] == ["assistant"]
        text = maybe_apply_chat_template(ex, tokenizer)
        r = render.render(tokenizer, row)
        assert text["prompt"] + text["completion"] == tokenizer.decode(r.prompt_ids + r.completion_ids)
    out = tmp_path / "openai.jsonl"
    assert run("--data", str(data), "--to", str(out), "--arguments", "text", "--agents", "weather") == 0
    calls = [tc for line in out.read_text().splitlines() for m in json.loads(line)["messages"]
             for tc in m.get("tool_calls", [])]
    assert calls and all(isinstance(tc["function"]["arguments"], str) for tc in calls)
    assert {json.dumps(json.loads(tc["function"]["arguments"]), sort_keys=True) for tc in calls} == {
        json.dumps(TOOL_ARGUMENTS, sort_keys=True)}


def test_polars_reads_the_parquet_as_the_help_shows(built, tmp_path):
    data, _ = built
    out = tmp_path / "sft.parquet"
    assert run("--data", str(data), "--to", str(out), "--rewarded") == 0
    df = pl.read_parquet(out)
    df = df.with_columns(df["messages"].ext.storage().str.json_decode())
    per_agent = dict(df.group_by("agent_name").agg(pl.len()).iter_rows())
    assert per_agent == {"weather_agent": 2, "writer": 1, "checker": 1, "rewriter": 1}
    assert df["messages"].list.last().struct.field("role").to_list() == ["assistant"] * 5


def test_rows_without_content_or_reward_are_left_out_and_counted(tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(DOCTOR / "capture_off" / "spans", data / "spans")
    build(TransformConfig(data=str(data), settle=0))
    assert run("--data", str(data), "--to", str(tmp_path / "x.jsonl")) == 1
    out = capsys.readouterr().out
    assert out.startswith("exported 0 of 4 transitions") and "4 without their messages" in out
    assert (tmp_path / "x.jsonl").read_text() == ""
    data = tmp_path / "unrated"
    shutil.copytree(DOCTOR / "no_agent" / "spans", data / "spans")
    build(TransformConfig(data=str(data), settle=0))
    assert run("--data", str(data), "--to", str(tmp_path / "y.jsonl"), "--rewarded") == 1
    assert "2 without a reward" in capsys.readouterr().out


@pytest.mark.parametrize("args,code,message", [
    (["--to", "{tmp}/out.csv"], 2, "must end in .parquet, .jsonl or .json"),
    (["--to", "{tmp}/nowhere/out.jsonl"], 2, "no folder"),
    (["--to", "{tmp}/out.jsonl", "--agents", "("], 2, "--agents is not a regular expression"),
    (["--to", "{tmp}/out.jsonl", "--data", "{tmp}/empty"], 1, "run `nightshift build` first"),
])
def test_bad_arguments_are_one_sentence(built, tmp_path, capsys, args, code, message):
    data, _ = built
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert run("--data", str(data), *args) == code
    err = capsys.readouterr().err
    assert err.startswith("nightshift export: ") and message in err and "Traceback" not in err
    assert not list(tmp_path.glob(".out*"))  # no temporary file left behind


def test_trls_sft_trainer_trains_on_the_export_as_it_loads(built, tiny_model, tmp_path):
    """What the README promises: `load_dataset` then `SFTTrainer`, nothing in between
    (the metadata columns ride along). prompt_completion's examples are TRL's own
    chat-template step's input above; one trainer run here keeps the test short."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    data, _ = built
    tok = AutoTokenizer.from_pretrained(tiny_model)
    for fmt in ("messages",):
        out = tmp_path / f"{fmt}.parquet"
        assert run("--data", str(data), "--to", str(out), "--format", fmt) == 0
        ds = datasets.load_dataset("parquet", data_files=str(out), split="train")
        trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model), processing_class=tok,
                             train_dataset=ds, args=SFTConfig(output_dir=str(tmp_path / fmt), max_steps=1,
                                                              per_device_train_batch_size=5, report_to=[],
                                                              use_cpu=True, save_strategy="no"))
        result = trainer.train()
        assert result.global_step == 1 and result.training_loss > 0
        assert len(trainer.train_dataset) == 5


def test_calls_answered_under_a_route_prompt_trial_are_left_out_and_counted(tmp_path, capsys):
    """A marked answer (`prompt_seen`, issue 27) was written to the route's candidate
    prompt: exported with the agent's recorded prompt, it would teach another trainer
    the answer to a state the model never had."""
    from transitions_data import row, write

    rows = [row(f"question {i}", f"answer number {i}", 1.0) for i in range(4)]
    for r in rows:
        r["prompt_seen"] = None
    rows[2]["prompt_seen"] = "0123456789ab"
    write(tmp_path / "data", rows)
    assert run("--data", str(tmp_path / "data"), "--to", str(tmp_path / "x.jsonl")) == 0
    out = capsys.readouterr().out
    assert out.startswith("exported 3 of 4 transitions") and "1 answered under a route's prompt trial" in out
    text = (tmp_path / "x.jsonl").read_text()
    assert "answer number 2" not in text and "answer number 3" in text
