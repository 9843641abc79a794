"""`train()` on a tiny model built offline: every algorithm, the direction of the
pg update, logged token ids, clipping, checkpoints vLLM would load, merging,
and every kind of bad data."""

from __future__ import annotations

import json
import re
import math
from pathlib import Path

import pytest
import torch

from nightshift.settings import apply
from nightshift.trainer import checkpoint as ckpt
from nightshift.trainer.config import TrainConfig
from nightshift.trainer.run import train
from nightshift.trainer.select import TrainDataError

from transitions_data import CALC_TOOL, msg, row, write

GOOD, BAD = "The answer is 4.", "I don't know."


def _cfg(tmp_path: Path, tiny_model: Path, **kw) -> TrainConfig:
    base = dict(data=str(tmp_path / "data"), base_model=str(tiny_model), output=str(tmp_path / "ckpt"),
                algorithm="pg", max_steps=4, batch_size=4, learning_rate=1e-3, logging_steps=1, tensorboard=False,
                served_model_name="Qwen/Qwen2.5-0.5B-Instruct")
    base.update(kw)
    cfg = TrainConfig()
    apply(cfg, base, "test")  # nested sections as mappings, like a YAML file
    return cfg


def _pairs(n: int, good_reward: float = 1.0, bad_reward: float = 0.0, tools: bool = False) -> list[dict]:
    rows = []
    for i in range(n):
        q = f"What is {i} + {i}?"
        mean = (good_reward + bad_reward) / 2
        if tools:
            call = msg("assistant", None, tool_calls=[{"id": f"c{i}", "name": "calculator", "arguments": {"expression": f"{i}+{i}"}}])
            rows.append(row(q, call, good_reward, advantage=good_reward - mean, group=q, tools=CALC_TOOL))
        else:
            rows.append(row(q, f"The answer is {2 * i}.", good_reward, advantage=good_reward - mean, group=q))
        rows.append(row(q, BAD, bad_reward, advantage=bad_reward - mean, group=q))
    return rows


def _logp(model, tok, prompt: str, answer: str) -> float:
    """log p(answer | prompt) under `model`, through the trainer's own renderer."""
    from nightshift.trainer.logprobs import completion_logprobs
    from nightshift.trainer.loop import collate
    from nightshift.trainer.render import render

    r = render(tok, row(prompt, answer, 1.0))
    batch = collate([{"input_ids": r.prompt_ids + r.completion_ids, "completion_start": len(r.prompt_ids),
                      "advantage": 0.0, "weight": 1.0}], tok.pad_token_id)
    with torch.no_grad():
        return completion_logprobs(model, batch).sum().item()


def _load(tiny_model: Path, version: str | None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    model = PeftModel.from_pretrained(base, version) if version else base
    return model.eval(), AutoTokenizer.from_pretrained(tiny_model)


@pytest.mark.parametrize("algorithm,packing", [("pg", "auto"), ("kto", "auto"), ("dpo", "auto"), ("sft", "auto"),
                                               ("sft", "off"), ("awr", "auto")])
def test_each_algorithm_trains_and_writes_a_version_vllm_can_load(tmp_path, tiny_model, algorithm, packing):
    write(tmp_path / "data", _pairs(12, tools=True) + _pairs(12))
    # padded sft also checkpoints every layer: the plan's flags reach a PEFT model's layers
    checkpointing = "on" if packing == "off" else "auto"
    res = train(_cfg(tmp_path, tiny_model, algorithm=algorithm, packing=packing,
                     gradient_checkpointing=checkpointing), progress=False)
    assert res.version == "v0001" and res.steps == 4 and res.tokens > 0
    vdir = Path(res.path)
    assert vdir == tmp_path / "ckpt" / "v0001"
    man = json.loads((vdir / "manifest.json").read_text())
    assert man["version"] == "v0001" and man["parent"] is None and man["algorithm"] == algorithm
    assert man["kind"] == "lora" and man["base_model"] == str(tiny_model)
    assert man["config"]["algorithm"] == algorithm and man["config"]["lora"]["r"] == 16
    assert man["dataset"]["rows_scanned"] == 48 and len(man["dataset"]["content_hash"]) == 64
    assert man["metrics"]["train"]["steps"] == 4 and man["code_version"]["trl"]
    plan = man["metrics"]["train"]["memory_plan"]  # the plan printed before step 1, kept
    assert plan["line"].startswith("memory plan: micro-batch ") and plan["max_length"] == 2048
    assert plan["checkpointing"] == ("full" if checkpointing == "on" else "off")
    assert man["metrics"]["train"]["packed"] == (packing != "off")
    assert set(man["metrics"]["eval"]["before"]) >= {"nll", "adv_weighted_logp", "kl_to_reference"}
    assert man["metrics"]["eval"]["after"]["kl_to_reference"] > 0  # it moved away from the base
    for name, digest in man["files"].items():
        assert len(digest) == 64 and (vdir / name).is_file()
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(man["files"])
    conf = json.loads((vdir / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert ckpt.vllm_problems(vdir, max_lora_rank=16) == []
    assert ckpt.vllm_problems(vdir, max_lora_rank=8) == ["LoRA rank 16 is greater than max_lora_rank 8"]
    # the adapter loads with peft on the base and changes its outputs
    model, tok = _load(tiny_model, str(vdir))
    base, _ = _load(tiny_model, None)
    assert _logp(model, tok, "What is 1 + 1?", GOOD) != pytest.approx(_logp(base, tok, "What is 1 + 1?", GOOD), abs=1e-6)


def test_steps_are_made_by_tokens_when_batch_size_is_0(tmp_path, tiny_model, capsys):
    """The default: each optimizer step about tokens_per_step tokens, however many rows
    that is; the plan says so before step 1."""
    write(tmp_path / "data", _pairs(24))
    res = train(_cfg(tmp_path, tiny_model, algorithm="sft", batch_size=0, tokens_per_step=300, max_steps=3,
                     eval_fraction=0.0), progress=False)
    err = capsys.readouterr().err
    plan = [ln for ln in err.splitlines() if ln.startswith(("memory plan:", "run plan:"))]
    assert len(plan) == 2 and "300 tokens per step" in plan[1], err[-2000:]
    first_step = err.index("step 1/3")
    assert all(err.index(ln) < first_step for ln in plan)  # printed before step 1
    assert res.steps == 3 and 150 <= res.tokens / 3 <= 450, res.tokens
    man = ckpt.read_manifest(res.path)["metrics"]["train"]
    assert (man["tokens_per_step"], man["rows_per_step"]) == (300, None)


@pytest.mark.parametrize("flip,packing", [(False, "off"), (True, "off"), (False, "on")])
def test_pg_raises_the_log_probability_of_the_rewarded_answer(tmp_path, tiny_model, flip, packing):
    q = "What is 2 + 2?"
    ra, rb = (0.0, 1.0) if flip else (1.0, 0.0)
    rows = [row(q, GOOD, ra, advantage=ra - 0.5, group=q, trajectory=f"a{i:031d}") for i in range(8)]
    rows += [row(q, BAD, rb, advantage=rb - 0.5, group=q, trajectory=f"b{i:031d}") for i in range(8)]
    write(tmp_path / "data", rows)
    base, tok = _load(tiny_model, None)
    before = _logp(base, tok, q, GOOD) - _logp(base, tok, q, BAD)
    res = train(_cfg(tmp_path, tiny_model, max_steps=12, eval_fraction=0.0, packing=packing), progress=False)
    model, _ = _load(tiny_model, res.path)
    after = _logp(model, tok, q, GOOD) - _logp(model, tok, q, BAD)
    if flip:
        assert after < before - 1.0, (before, after)
    else:
        assert after > before + 1.0, (before, after)


def _logged_rows(tok, n: int, logprob: float | None, drift: int = 0, whole: bool = False) -> list[dict]:
    """Rows carrying the token ids a server would have logged: ours (the sampled
    completion without the template's closing newline unless `whole`), or
    perturbed for the first `drift` rows."""
    from nightshift.trainer.render import render

    rows = []
    for i in range(n):
        q = f"What is {i} + {i}?"
        r = row(q, f"The answer is {2 * i}.", 1.0, advantage=0.5, group=q)
        ids = render(tok, r)
        completion = ids.completion_ids if whole else ids.completion_ids[:-1]  # "\n" after <|im_end|> is the template's
        prompt = ids.prompt_ids if i >= drift else ids.prompt_ids[:-1] + [ids.prompt_ids[-1] + 1]
        r.update(prompt_token_ids=prompt, completion_token_ids=completion,
                 completion_logprobs=[logprob] * len(completion) if logprob is not None else None)
        rows.append(r)
    return rows


def test_logged_token_ids_are_compared_and_drift_is_reported(tmp_path, tiny_model):
    _, tok = _load(tiny_model, None)
    write(tmp_path / "data", _logged_rows(tok, 10, -2.0, drift=3) + _pairs(3))
    res = train(_cfg(tmp_path, tiny_model, eval_fraction=0.0, served_model_name="tiny"), progress=False)
    assert res.logged["match"] == 7 and res.logged["drift"] == 3 and res.logged["none"] == 6
    assert res.logged["with_logprobs"] == 7
    text = "\n".join(res.lines())
    assert "7 match this tokenizer (7 with logprobs), 3 drifted" in text
    # μ: the 7 logged kept; the 3 drifted and the 6 without ids made by the base model
    # (their model is the base's name), so recomputed with its weights
    assert (res.logged["mu_logged"], res.logged["mu_recomputed"], res.logged.get("mu_unknown", 0)) == (7, 9, 0)
    assert "7 logged, 9 recomputed" in text
    # the logged numbers (-2.0 per token) are not the base model's: the drift says so
    drift = float(re.search(r"mean \|Δ log μ\| ([0-9.]+) per token over (\d+) tokens", text).group(1))
    assert drift > 0.1


def test_ppo_clip_bounds_the_update(tmp_path, tiny_model):
    """Every logged token far less likely under μ than under π (ratio ≫ 1+ε) with a
    positive advantage: PPO's clip leaves the adapter untouched; no clip moves it."""
    from safetensors.torch import load_file

    _, tok = _load(tiny_model, None)
    write(tmp_path / "data", _logged_rows(tok, 8, -30.0, whole=True))

    def lora_b_norm(clip: str, out: str) -> float:
        res = train(_cfg(tmp_path, tiny_model, output=str(tmp_path / out), eval_fraction=0.0,
                         pg={"clip": clip}), progress=False)
        w = load_file(str(Path(res.path) / "adapter_model.safetensors"))
        return sum(t.float().norm().item() for k, t in w.items() if "lora_B" in k)

    assert lora_b_norm("ppo", "clipped") == 0.0
    assert lora_b_norm("none", "unclipped") > 0.0


def test_merged_weights_give_the_same_logits_as_the_adapter(tmp_path, tiny_model):
    from transformers import AutoModelForCausalLM

    from nightshift.trainer.merge import MergeError, merge

    write(tmp_path / "data", _pairs(8))
    res = train(_cfg(tmp_path, tiny_model), progress=False)
    out = merge(res.path, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    adapter, tok = _load(tiny_model, res.path)
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": "What is 3 + 3?"}],
                                                add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, adapter(ids).logits, atol=1e-5)
    assert json.loads((out / "merged_from.json").read_text())["version"] == "v0001"
    with pytest.raises(MergeError, match="not a checkpoint"):
        merge(tmp_path, tmp_path / "m2")


def test_continuing_from_a_published_adapter_records_the_parent(tmp_path, tiny_model):
    write(tmp_path / "data", _pairs(8))
    first = train(_cfg(tmp_path, tiny_model), progress=False)
    second = train(_cfg(tmp_path, tiny_model, init_adapter=first.path, pg={"kl_coef": 0.1, "reference": "init"}),
                   progress=False)
    assert second.version == "v0002"
    man = ckpt.read_manifest(second.path)
    assert man["parent"] == "v0001"
    # evaluated against the policy it started from: no distance before, some after
    assert man["metrics"]["eval"]["before"]["kl_to_reference"] == pytest.approx(0.0, abs=1e-6)
    assert man["metrics"]["eval"]["after"]["kl_to_reference"] > 0
    assert ckpt.versions(str(tmp_path / "ckpt")) == ["v0001", "v0002"]


def test_full_finetune_writes_full_weights(tmp_path, tiny_model):
    from transformers import AutoModelForCausalLM

    write(tmp_path / "data", _pairs(6))
    res = train(_cfg(tmp_path, tiny_model, full_finetune=True, learning_rate=1e-4), progress=False)
    assert ckpt.read_manifest(res.path)["kind"] == "full"
    assert AutoModelForCausalLM.from_pretrained(res.path) is not None


def test_output_on_an_object_store(tmp_path, tiny_model):
    import fsspec

    write(tmp_path / "data", _pairs(6))
    url = "memory://nightshift-test/ckpts"
    res = train(_cfg(tmp_path, tiny_model, output=url, work_dir=str(tmp_path / "work")), progress=False)
    assert res.path == f"{url}/v0001"
    fs = fsspec.filesystem("memory")
    assert fs.exists("/nightshift-test/ckpts/v0001/adapter_model.safetensors")
    assert ckpt.versions(url) == ["v0001"] and ckpt.read_manifest(res.path)["version"] == "v0001"
    assert not list((tmp_path / "work").glob(".tmp-*"))  # staging cleaned up


# --- bad data ---------------------------------------------------------------------------


def test_empty_selection_is_a_clear_error(tmp_path, tiny_model):
    with pytest.raises(TrainDataError, match="no transitions dataset"):
        train(_cfg(tmp_path, tiny_model), progress=False)
    write(tmp_path / "data", _pairs(4))
    with pytest.raises(TrainDataError, match="no transitions files .* between 2030-01-01 and the end"):
        train(_cfg(tmp_path, tiny_model, select={"since": "2030-01-01"}), progress=False)
    with pytest.raises(TrainDataError, match="8 agent not selected"):
        train(_cfg(tmp_path, tiny_model, select={"agents": "^nobody$"}), progress=False)


def test_missing_columns_are_named(tmp_path, tiny_model):
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "data" / "transitions" / "date=2026-11-20"
    d.mkdir(parents=True)
    pq.write_table(pa.table({"transition_id": ["a"], "trajectory_id": ["t"], "output_message": ["hi"]}), d / "x.parquet")
    from nightshift.schemas.layout import LayoutError  # exit 2 through `nightshift train` (tests/test_dataset_layout.py)

    with pytest.raises(LayoutError, match="x.parquet .* lacks the column\\(s\\) input_messages, reward, advantage"):
        train(_cfg(tmp_path, tiny_model), progress=False)


def test_non_finite_rewards_are_left_out_and_counted(tmp_path, tiny_model):
    rows = _pairs(6)
    rows[0]["reward"] = math.nan
    rows[1]["reward"] = math.inf
    rows[2]["advantage"] = math.nan
    rows[3]["reward"] = None
    write(tmp_path / "data", rows)
    res = train(_cfg(tmp_path, tiny_model, eval_fraction=0.0), progress=False)
    assert res.excluded == {"reward not finite (NaN or infinite)": 2, "advantage not finite (NaN or infinite)": 1,
                            "no reward": 1}
    assert res.rows_trained == 8
    for r in rows:
        r["reward"] = math.nan
    write(tmp_path / "data", rows)
    with pytest.raises(TrainDataError, match="12 reward not finite"):
        train(_cfg(tmp_path, tiny_model), progress=False)


def test_overlong_rows_are_left_out_not_truncated_and_counted_per_agent(tmp_path, tiny_model):
    rows = _pairs(4) + [row("word " * 400, GOOD, 1.0, advantage=0.5, agent="writer"),
                        row("word " * 500, BAD, 0.0, advantage=-0.5, agent="writer"),
                        row("word " * 450, GOOD, 1.0, advantage=0.5, agent="critic")]
    write(tmp_path / "data", rows)
    res = train(_cfg(tmp_path, tiny_model, max_length=256, eval_fraction=0.0), progress=False)
    assert res.excluded == {"longer than max_length (256 tokens)": 3}
    assert "  left out: 3 longer than max_length (256 tokens): writer 2, critic 1" in res.lines()
    assert ckpt.read_manifest(res.path)["dataset"]["too_long_by_agent"] == {"writer": 2, "critic": 1}
    with pytest.raises(TrainDataError, match="11 longer than max_length \\(8 tokens\\)"):
        train(_cfg(tmp_path, tiny_model, max_length=8), progress=False)


def test_max_length_is_the_models_own_limit_unless_set(tmp_path, tiny_model):
    """0 (the default): the model's max_position_embeddings (the tiny model's 2,048), not
    a fixed 2048 that drops every agent call of 4-16k tokens on a 32k model."""
    long = "word " * 2100  # over 2,048 tokens
    write(tmp_path / "data", _pairs(3) + [row(long, GOOD, 1.0, advantage=0.5, agent="writer")])
    res = train(_cfg(tmp_path, tiny_model, eval_fraction=0.0), progress=False)
    assert TrainConfig().max_length == 0
    assert res.excluded == {"longer than max_length (2,048 tokens)": 1} and res.too_long == {"writer": 1}
    man = ckpt.read_manifest(res.path)
    assert man["metrics"]["train"]["memory_plan"]["max_length"] == 2048


def test_tokenizer_without_a_chat_template(tmp_path, tiny_model):
    import shutil

    from nightshift.trainer.tiny import CHATML

    bare = tmp_path / "bare"
    shutil.copytree(tiny_model, bare)
    (bare / "chat_template.jinja").unlink()
    conf = json.loads((bare / "tokenizer_config.json").read_text())
    conf.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(conf))
    write(tmp_path / "data", _pairs(4))
    with pytest.raises(TrainDataError, match="has no chat template.*chat_template"):
        train(_cfg(tmp_path, tiny_model, base_model=str(bare)), progress=False)
    (tmp_path / "t.jinja").write_text(CHATML)
    res = train(_cfg(tmp_path, tiny_model, base_model=str(bare), chat_template=str(tmp_path / "t.jinja")), progress=False)
    assert res.version == "v0001"


def test_kto_needs_both_labels_and_dpo_needs_pairs(tmp_path, tiny_model):
    rows = [row(f"q{i}", GOOD, 1.0, group=f"q{i}") for i in range(6)]
    write(tmp_path / "data", rows)
    with pytest.raises(TrainDataError, match="kto needs desirable and undesirable rows, but all .* above"):
        train(_cfg(tmp_path, tiny_model, algorithm="kto"), progress=False)
    with pytest.raises(TrainDataError, match="dpo: no training examples .* no other answer to the same prompt"):
        train(_cfg(tmp_path, tiny_model, algorithm="dpo"), progress=False)
    close = [row("q", GOOD, 0.5, group="q"), row("q", BAD, 0.45, group="q")]
    write(tmp_path / "data", close)
    with pytest.raises(TrainDataError, match="within dpo.min_margin"):
        train(_cfg(tmp_path, tiny_model, algorithm="dpo", eval_fraction=0.0), progress=False)


def test_a_template_that_fails_is_counted_with_its_message(tmp_path, tiny_model):
    rows = _pairs(4) + [row([msg("mystery", "hi")], GOOD, 1.0)]
    write(tmp_path / "data", rows)
    template = ("{%- for m in messages %}{%- if m.role == 'mystery' %}{{ raise_exception('unknown role') }}{%- endif %}"
                "{{ m.role + ': ' + m.content + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}assistant: {%- endif %}")
    (tmp_path / "t.jinja").write_text(template)
    res = train(_cfg(tmp_path, tiny_model, chat_template=str(tmp_path / "t.jinja"), eval_fraction=0.0), progress=False)
    assert res.excluded == {"chat template failed": 1}
    assert any("unknown role" in n for n in res.notes)


def test_settings_from_yaml_and_environment(tmp_path):
    from nightshift.settings import SettingsError, load

    f = tmp_path / "n.yaml"
    f.write_text("data: /d\ntrain:\n  base_model: /m\n  algorithm: kto\n  pg: {clip: truncate}\n  select: {models: [a, b]}\n")
    cfg = load(TrainConfig, "train", str(f), {"batch_size": 4},
               env={"NIGHTSHIFT_TRAIN_PG_KL_COEF": "0.05", "NIGHTSHIFT_TRAIN_LORA_R": "32"})
    assert (cfg.data, cfg.base_model, cfg.algorithm, cfg.pg.clip, cfg.pg.kl_coef, cfg.lora.r, cfg.batch_size) == \
        ("/d", "/m", "kto", "truncate", 0.05, 32, 4)
    assert cfg.select.models == ["a", "b"]
    cfg.check()
    cfg.algorithm = "grpo"
    with pytest.raises(SettingsError, match=r"^train\.algorithm: must be one of pg, awr, sft, kto, dpo, got 'grpo'"):
        cfg.check()
    cfg.algorithm, cfg.lora.r = "pg", 1024
    with pytest.raises(SettingsError, match=r"^train\.lora\.r: must be in \[1, 512\], got 1024"):
        cfg.check()


def test_a_trainer_checkpoint_cut_short_by_a_kill_is_not_resumed_from(tmp_path):
    from nightshift.trainer.run import _last_checkpoint

    (tmp_path / "checkpoint-5").mkdir()
    (tmp_path / "checkpoint-5" / "trainer_state.json").write_text('{"global_step": 5}')
    (tmp_path / "checkpoint-10").mkdir()  # model written, killed before trainer_state.json
    (tmp_path / "checkpoint-10" / "model.safetensors").write_bytes(b"x")
    (tmp_path / "checkpoint-15").mkdir()
    (tmp_path / "checkpoint-15" / "trainer_state.json").write_text('{"global_st')  # torn
    assert _last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-5")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-5"]
    assert _last_checkpoint(tmp_path / "absent") == ""


def test_vllm_constraints_on_adapter_config(tmp_path):
    from safetensors.torch import save_file

    good = {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "bias": "none", "use_dora": False,
            "target_modules": ["q_proj"], "init_lora_weights": True, "modules_to_save": None}
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(16, 8),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(8, 16)},
              str(tmp_path / "adapter_model.safetensors"))
    for change, problem in [({}, None), ({"use_dora": True}, "DoRA"), ({"bias": "all"}, "bias='all'"),
                            ({"modules_to_save": ["lm_head"]}, "modules_to_save ['lm_head']"),
                            ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa'"),
                            ({"peft_type": "IA3"}, "LORA only"),
                            ({"rank_pattern": {"q_proj": 64}}, "LoRA rank 64 is greater than max_lora_rank 32")]:
        (tmp_path / "adapter_config.json").write_text(json.dumps({**good, **change}))
        problems = ckpt.vllm_problems(tmp_path, max_lora_rank=32)
        if problem is None:
            assert problems == []
        else:
            assert len(problems) == 1 and problem in problems[0], (change, problems)
    (tmp_path / "adapter_config.json").write_text(json.dumps(good))
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, str(tmp_path / "adapter_model.safetensors"))
    assert "unexpected tensor names" in ckpt.vllm_problems(tmp_path)[0]


def test_mu_is_recomputed_with_the_weights_of_the_version_that_made_each_call(tmp_path, tiny_model):
    """Night 2 trains on calls of night 1's adapter (`policy_version` v0001) and of the
    base: each row's μ comes from its own producer; a version missing from disk
    leaves μ unknown (its negatives dropped by default), said in the summary."""
    from nightshift.trainer import behaviour
    from nightshift.trainer.plan import work_out

    write(tmp_path / "data", _pairs(4))
    first = train(_cfg(tmp_path, tiny_model, eval_fraction=0.0, served_model_name="tiny"), progress=False)
    assert first.version == "v0001"
    rows = [{**r, "policy_version": "v0001"} for r in _pairs(3)] + [{**r, "policy_version": "v0099"} for r in _pairs(1)]
    write(tmp_path / "data", _pairs(2) + rows, date="2026-11-21")
    res = train(_cfg(tmp_path, tiny_model, eval_fraction=0.0, served_model_name="tiny"), progress=False)
    text = "\n".join(res.lines())
    assert (res.logged["mu_recomputed"], res.logged["mu_unknown"]) == (8 + 4 + 6, 2), text
    assert "μ producers: base 12, v0001 6" in text
    # its cost apart: rows and tokens through a forward, and the time (the benchmark prints it)
    assert re.search(r"μ: 18 rows recomputed \([0-9,]+ tokens\) in [0-9.]+ s", text), text
    mu = ckpt.read_manifest(res.path)["metrics"]["train"]["mu"]
    assert mu["rows"] == 18 and mu["tokens"] > 18 and mu["seconds"] > 0 and mu["unknown"] == 2
    # and the numbers are v0001's own: recomputed here against a direct forward pass of it
    # fp32 and the same device as the recomputation: on a GPU too, the two differ only by the
    # order of fp32 sums (~1e-6), not by bf16 against a CPU's fp32 (~1e-2)
    cfg = _cfg(tmp_path, tiny_model, eval_fraction=0.0, served_model_name="tiny", precision="fp32")
    _, tok = _load(tiny_model, None)
    from nightshift.trainer.render import render

    r = rows[0]
    rd = render(tok, r)
    feat = {"input_ids": rd.prompt_ids + rd.completion_ids, "completion_start": len(rd.prompt_ids), "advantage": 1.0,
            "weight": 1.0, "old_logprobs": None, "policy_version": "v0001", "temperature": 0.5, "model": "tiny"}
    plan = work_out(cfg)
    mu = behaviour.attach(cfg, plan, [feat], tok)
    assert (mu.rows, mu.tokens) == (1, len(feat["input_ids"])) and mu.seconds > 0
    model, _ = _load(tiny_model, first.path)
    model.to(plan.device)
    with torch.no_grad():
        logits = model(torch.tensor([feat["input_ids"]], device=plan.device)).logits[0].float().cpu()
    want = [torch.log_softmax(logits[p - 1] / 0.5, -1)[feat["input_ids"][p]].item()
            for p in range(feat["completion_start"], len(feat["input_ids"]))]
    assert feat["old_logprobs"] == pytest.approx(want, abs=1e-4)


def test_each_logging_step_prints_one_line_computed_from_the_steps_that_ran(tmp_path, tiny_model, capsys):
    write(tmp_path / "data", _pairs(12))
    res = train(_cfg(tmp_path, tiny_model, max_steps=3, logging_steps=1, tensorboard=True), progress=False)
    capsys_err = capsys.readouterr().err
    lines = [ln for ln in capsys_err.splitlines() if ln.startswith("step ")]
    assert [ln.split(" | ")[0] for ln in lines] == ["step 1/3", "step 2/3", "step 3/3"]
    fields = [dict(p.split(" ", 1) if not p.endswith("tok/s") else ("tok/s", p.split()[0]) for p in ln.split(" | ")[1:])
              for ln in lines]
    # the trainer's own mean loss is the mean of the losses the lines show
    assert sum(float(f["loss"]) for f in fields) / 3 == pytest.approx(res.train_loss, abs=1e-3)
    assert all(float(f["tok/s"].replace(",", "")) > 0 for f in fields) and fields[-1]["ETA"] == "0s"
    # MFU where the device has a datasheet peak (a GPU of the table), said how once; a CPU has none
    from nightshift.trainer.plan import work_out
    from nightshift.trainer.steplog import peak_flops

    device = work_out(_cfg(tmp_path, tiny_model)).device_name
    measured = peak_flops(device) is not None
    assert all(("MFU" in ln) == measured for ln in lines), (device, lines)
    assert ("TFLOP/s (dense bf16 datasheet peak)" in capsys_err) == measured
    # tokens/s reached TensorBoard beside the loss
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(Path(res.path) / "tensorboard")).Reload()
    assert {"train/loss", "train/tokens_per_second"} <= set(ev.Tags()["scalars"])
    assert len(ev.Scalars("train/tokens_per_second")) == 3


def test_mfu_is_tokens_per_second_against_the_device_peak():
    from nightshift.trainer.steplog import flops_per_token, peak_flops

    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and peak_flops("cpu-thing") is None
    # 0.5B parameters, LoRA adapters of 8M: 4N + 2n per token
    assert flops_per_token(500_000_000, 8_000_000) == 2_016_000_000
