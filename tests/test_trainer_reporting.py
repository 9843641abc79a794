"""Training reports where the team looks (issue 26, item 5): `train.report_to`
(tensorboard, wandb, mlflow, none) through transformers' own integrations, the
step line kept; `train.trainer_args` passed to TrainingArguments, the arguments
Nightshift owns refused with the setting to use instead.

mlflow is not installed here (nor with Nightshift): a stand-in package written by
the test takes its place on sys.path, recording the calls transformers'
MLflowCallback makes. What is tested is Nightshift's side: that the integration
is built, placed after the step line, fed every logged record, and given the
user's TrainingArguments."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from nightshift.settings import SettingsError, apply
from nightshift.trainer.config import OWNED_TRAINER_ARGS, TrainConfig
from nightshift.trainer.run import train

from transitions_data import row, write

FAKE_MLFLOW = '''"""Stand-in for the mlflow package: each call MLflowCallback makes, as a JSON line."""
import json, os
from . import utils
__version__ = "2.20.0"
_run = None
_uri = None
def _log(call, **kw):
    with open(os.environ["FAKE_MLFLOW_LOG"], "a") as f:
        f.write(json.dumps({"call": call, **kw}, default=str) + "\\n")
def is_tracking_uri_set(): return _uri is not None
def set_tracking_uri(uri):
    global _uri
    _uri = uri
    _log("set_tracking_uri", uri=uri)
def get_tracking_uri(): return _uri
def set_experiment(name): _log("set_experiment", name=name)
class _Info: run_id = "stand-in"
class _Run: info = _Info()
def active_run(): return _run
def start_run(run_name=None, nested=False):
    global _run
    _run = _Run()
    _log("start_run", run_name=run_name)
    return _run
def end_run():
    global _run
    _run = None
    _log("end_run")
def log_params(params, synchronous=True): _log("log_params", params=params)
def log_metrics(metrics, step=None, synchronous=True): _log("log_metrics", metrics=metrics, step=step)
def set_tags(tags): _log("set_tags", tags=tags)
'''


def _cfg(tmp_path: Path, tiny_model: Path, **kw) -> TrainConfig:
    cfg = TrainConfig()
    apply(cfg, dict(data=str(tmp_path / "data"), base_model=str(tiny_model), output=str(tmp_path / "ck"),
                    max_steps=2, batch_size=4, learning_rate=1e-3, logging_steps=1, eval_fraction=0.0, **kw), "test")
    return cfg


@pytest.fixture
def fake_mlflow(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "site"
    (root / "mlflow" / "utils").mkdir(parents=True)
    (root / "mlflow" / "__init__.py").write_text(FAKE_MLFLOW)
    (root / "mlflow" / "utils" / "__init__.py").write_text("from . import validation\n")
    (root / "mlflow" / "utils" / "validation.py").write_text("MAX_PARAM_VAL_LENGTH = 6000\n"
                                                             "MAX_PARAMS_TAGS_PER_BATCH = 100\n")
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    log = tmp_path / "mlflow-calls.jsonl"
    monkeypatch.setenv("FAKE_MLFLOW_LOG", str(log))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    yield log
    for name in [m for m in sys.modules if m == "mlflow" or m.startswith("mlflow.")]:
        del sys.modules[name]


def test_report_to_mlflow_gets_every_record_after_the_step_line(tmp_path, tiny_model, fake_mlflow, capsys):
    write(tmp_path / "data", [row(f"What is {i} + {i}?", f"The answer is {2 * i}.", 1.0) for i in range(12)])
    cfg = _cfg(tmp_path, tiny_model, report_to=["mlflow"], trainer_args={"lr_scheduler_type": "constant"})
    res = train(cfg, progress=False)
    calls = [json.loads(line) for line in fake_mlflow.read_text().splitlines()]
    names = [c["call"] for c in calls]
    assert names[0] == "set_tracking_uri" and calls[0]["uri"] == f"file:{tmp_path / 'mlruns'}"
    assert "start_run" in names and names[-1] == "end_run"
    params = {k: v for c in calls if c["call"] == "log_params" for k, v in c["params"].items()}
    assert params["lr_scheduler_type"] == "constant" and params["max_steps"] == 2  # the user's argument arrived
    steps = {c["step"]: c["metrics"] for c in calls if c["call"] == "log_metrics" and "loss" in c["metrics"]}
    assert sorted(steps) == [1, 2]
    for m in steps.values():
        assert m["tokens_per_second"] > 0  # added by the step line, which runs first
        assert m["learning_rate"] == pytest.approx(1e-3)  # constant: linear would have decayed it by step 2
    err = capsys.readouterr().err
    assert [ln.split(" | ")[0] for ln in err.splitlines() if ln.startswith("step ")] == ["step 1/2", "step 2/2"]
    assert not (Path(res.path) / "tensorboard").exists()  # report_to without tensorboard: none written


def test_report_to_and_trainer_args_are_checked_before_any_work(tmp_path, tiny_model, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(SettingsError, match=r"report_to.*wandb needs the wandb package.*pip install wandb"):
        _cfg(tmp_path, tiny_model, report_to=["tensorboard", "wandb"]).check()
    with pytest.raises(SettingsError, match="none means nowhere"):
        _cfg(tmp_path, tiny_model, report_to=["none", "tensorboard"]).check()
    with pytest.raises(SettingsError, match="must be one of tensorboard, wandb, mlflow, none"):
        _cfg(tmp_path, tiny_model, report_to=["comet"]).check()
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps", "output_dir", "max_steps"):
        with pytest.raises(SettingsError, match=rf"train.trainer_args.*{key} is Nightshift's: set "):
            _cfg(tmp_path, tiny_model, trainer_args={key: 1, "optim": "adamw_torch"}).check()
    assert "learning_rate" in OWNED_TRAINER_ARGS and "lr_scheduler_type" not in OWNED_TRAINER_ARGS
    # an unknown key: refused before the data is read (there is none here: that would be another error)
    with pytest.raises(SettingsError, match="'lr_sheduler' is not a transformers TrainingArguments field"):
        train(_cfg(tmp_path, tiny_model, trainer_args={"lr_sheduler": "cosine"}), progress=False)
    # where figures go: report_to, less TensorBoard when the older `tensorboard: false` says so
    assert _cfg(tmp_path, tiny_model).reporters() == ["tensorboard"]
    assert _cfg(tmp_path, tiny_model, report_to=["tensorboard", "mlflow"], tensorboard=False).reporters() == ["mlflow"]
    assert _cfg(tmp_path, tiny_model, report_to=["none"]).reporters() == []
