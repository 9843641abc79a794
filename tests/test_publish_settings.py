"""Publish's settings have one home (issue 27 item 6): the `publish:` section and
NIGHTSHIFT_PUBLISH_*, read by publish, rollback, watch and nightly alike. Files and
environments that still give the keys under `nightly:` (their old place) keep
working, with one line naming the new key; both places given and different is one
sentence naming both. And a publication by hand no longer waits for the nightly
job's imports (Polars)."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys

import pytest

from nightshift.nightly.run import NightlyConfig
from nightshift.publish.publish import MOVED, PublishSettings
from nightshift.settings import SettingsError, load


def _main(argv: list) -> tuple[int, str]:
    from nightshift.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main([str(a) for a in argv])
    return code, out.getvalue()


def _clean(monkeypatch) -> None:
    import os

    for var in [v for v in os.environ if v.startswith(("NIGHTSHIFT_PUBLISH_", "NIGHTSHIFT_NIGHTLY_"))]:
        monkeypatch.delenv(var)


def test_publish_and_nightly_read_the_publish_section_and_the_old_place_still_works_with_a_note(tmp_path):
    new, old = tmp_path / "new.yaml", tmp_path / "old.yaml"
    new.write_text("publish: {vllm_url: 'http://vllm:8000', name: support, keep: 4, stable_name: s}\n"
                   "nightly: {train_window_days: 3, canary: {share: 0.1, route_url: 'http://r:1'}}\n")
    old.write_text("nightly: {vllm_url: 'http://vllm:8000', name: support, keep: 4, train_window_days: 3}\n")
    said: list[str] = []
    s = load(PublishSettings, "publish", str(new), {}, {}, moved=MOVED, notes=said)
    n = load(NightlyConfig, "nightly", str(new), {}, {}, moved=MOVED, notes=said)
    assert (s.vllm_url, s.name, s.keep) == (n.vllm_url, n.name, n.keep) == ("http://vllm:8000", "support", 4)
    assert n.train_window_days == 3 and n.stable_name == "s" and said == []  # the nightly job's own keys stay put

    for cls, section in ((PublishSettings, "publish"), (NightlyConfig, "nightly")):
        said = []
        got = load(cls, section, str(old), {}, {}, moved=MOVED, notes=said)
        assert (got.vllm_url, got.name, got.keep) == ("http://vllm:8000", "support", 4)
        assert said[0] == (f"{old}: nightly.vllm_url is deprecated: use publish.vllm_url (the same setting; "
                           "nightly.vllm_url still works for now)"), said
        assert len(said) == 3 and all("is deprecated: use" in x for x in said)


def test_both_places_given_and_different_is_one_sentence_naming_both(tmp_path):
    conf = tmp_path / "n.yaml"
    conf.write_text("publish: {vllm_url: 'http://a:8000'}\nnightly: {vllm_url: 'http://b:8000'}\n")
    for cls, section in ((PublishSettings, "publish"), (NightlyConfig, "nightly")):
        with pytest.raises(SettingsError, match=r"publish\.vllm_url \('http://a:8000'\) and .*nightly\.vllm_url "
                                                r"\('http://b:8000'\) are both given and differ"):
            load(cls, section, str(conf), {}, {}, moved=MOVED)
    # the same value in both places is no conflict (a file half-way through its migration)
    conf.write_text("publish: {keep: 2}\nnightly: {keep: 2}\n")
    assert load(PublishSettings, "publish", str(conf), {}, {}, moved=MOVED).keep == 2
    # the environment alike: the old variable works with a note; both set and different is refused
    said: list[str] = []
    env = {"NIGHTSHIFT_NIGHTLY_KEEP": "5"}
    assert load(NightlyConfig, "nightly", None, {}, env, moved=MOVED, notes=said).keep == 5
    assert load(PublishSettings, "publish", None, {}, env, moved=MOVED, notes=said).keep == 5
    assert said == ["NIGHTSHIFT_NIGHTLY_KEEP is deprecated: use NIGHTSHIFT_PUBLISH_KEEP (the same setting; "
                    "NIGHTSHIFT_NIGHTLY_KEEP still works for now)"]
    with pytest.raises(SettingsError, match="NIGHTSHIFT_PUBLISH_KEEP .* and NIGHTSHIFT_NIGHTLY_KEEP .* both given"):
        load(PublishSettings, "publish", None, {}, {**env, "NIGHTSHIFT_PUBLISH_KEEP": "6"}, moved=MOVED)
    # a bad value is named with the variable it came from, old place or new
    with pytest.raises(SettingsError, match=r"^NIGHTSHIFT_NIGHTLY_KEEP='0' \(publish\.keep\): must be in"):
        load(PublishSettings, "publish", None, {}, {"NIGHTSHIFT_NIGHTLY_KEEP": "0"}, moved=MOVED)
    # a typo in the new section is refused like any other
    conf.write_text("publish: {vllm_ur: 'http://a:8000'}\n")
    for cls, section in ((PublishSettings, "publish"), (NightlyConfig, "nightly")):  # the job reads it too
        with pytest.raises(SettingsError, match=r"publish\.vllm_ur.*unknown setting 'vllm_ur' \(did you mean "
                                                r"'vllm_url'\?\)"):
            load(cls, section, str(conf), {}, {}, moved=MOVED)


def test_the_commands_say_the_deprecation_once_and_refuse_a_conflict_with_exit_2(tmp_path, monkeypatch):
    _clean(monkeypatch)
    ck = tmp_path / "ck"
    ck.mkdir()
    conf = tmp_path / "n.yaml"
    conf.write_text(f"train: {{output: {ck}}}\nnightly: {{vllm_url: 'http://127.0.0.1:9', name: agent}}\n")
    code, out = _main(["rollback", "--config", conf])
    assert code == 1 and "nothing has been published to http://127.0.0.1:9 as 'agent'" in out, out
    assert out.count(f"{conf}: nightly.vllm_url is deprecated: use publish.vllm_url") == 1, out
    code, out = _main(["watch", "--config", conf, "--data", tmp_path / "data", "--dry-run"])
    assert out.count("nightly.name is deprecated: use") == 1, out

    conf.write_text(f"train: {{output: {ck}, base_model: {tmp_path}}}\npublish: {{name: agent}}\nnightly: {{name: other}}\n")
    for argv in (["publish", "--vllm-url", "http://127.0.0.1:9", "--checkpoint", "v0001"], ["nightly"],
                 ["watch", "--data", tmp_path / "data"]):
        code, out = _main([*argv, "--config", conf])
        assert code == 2 and "publish.name ('agent') and" in out and "nightly.name ('other') are both given" in out, \
            (argv, out)
        assert "Traceback" not in out


def test_publish_help_names_the_new_section_and_imports_neither_the_nightly_job_nor_polars():
    code = ("import contextlib, io, sys\nfrom nightshift.cli.main import main\nout = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n    try:\n        main(['publish', '--help'])\n"
            "    except SystemExit:\n        pass\n"
            "print(json.dumps({'help': out.getvalue(), 'mods': sorted(m for m in sys.modules "
            "if m == 'polars' or m.startswith('nightshift.nightly'))}))")
    p = subprocess.run([sys.executable, "-c", "import json\n" + code], capture_output=True, text=True, timeout=120)
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert "the `publish:` section" in got["help"] and "NIGHTSHIFT_PUBLISH_*" in got["help"]
    assert got["mods"] == [], got["mods"]
