"""`nightshift versions` on the input production gives it: traffic with a weekly
shape (each version beside its predecessor over the same hours of the week),
versions nobody published or whose name is malformed, versions deleted from disk
(and `rollback` when the version to go back to is gone), clocks hours off, and
rewards that are NaN, infinite or missing."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nightshift.publish import registry
from nightshift.publish.publish import PublishError, publish, rollback
from nightshift.judge.versions import (ALL, BASE, by_version, calls, chi2_sf, lines, trajectory_rewards,
                                         weekly_shape)
from nightshift.judge.watch import rewards_of
from transitions_data import row, write

UTC = dt.timezone.utc
MON = dt.datetime(2026, 11, 2, tzinfo=UTC)  # a Monday


def _traj(version: str | None, rewards: float | None | list, when: dt.datetime, key: str,
          agent: str = "writer", steps: int = 2) -> list[dict]:
    """One trajectory of `steps` calls by `version`; `rewards`: one per step, or the
    outcome on every step."""
    per_step = rewards if isinstance(rewards, list) else [rewards] * steps
    traj = hashlib.sha256(f"{version}-{agent}-{key}".encode()).hexdigest()[:32]
    out = []
    for s, r in enumerate(per_step):
        x = row(f"task {key}", f"answer {s}", r, trajectory=traj, step=s, num_steps=len(per_step), agent=agent,
                when=when + dt.timedelta(seconds=10 * s), model=f"agent@{version}" if version else "tiny")
        x["policy_version"] = version
        out.append(x)
    return out


def _by_key(table) -> dict:
    return {(s.version, s.agent): s for s in table}


def _registry(ck: Path, *pubs: tuple[str, dt.datetime], rollback_of: dict | None = None) -> None:
    for v, t in pubs:
        registry.append(str(ck), {"version": v, "name": f"agent@{v}", "endpoint": "http://vllm:8000", "mode": "lora",
                                  "time": t.isoformat(), "rollback_of": (rollback_of or {}).get((v, t))})


# -- weekly shape --------------------------------------------------------------------------

def _weekly_world() -> list[dict]:
    """v0001 serves two weeks: 80 % success on weekdays, 30 % at the weekend. v0002,
    published Monday 16 Nov 00:00, serves Monday to Wednesday at 80 %: no better than
    v0001 on the same days, though better than v0001's whole-week mean (about 66 %)."""
    rows = []
    for day in range(14):
        weekend = (MON + dt.timedelta(days=day)).weekday() >= 5
        for i in range(20):
            r = float(i % 10 < 3) if weekend else float(i % 5 != 0)
            rows += _traj("v0001", r, MON + dt.timedelta(days=day, hours=8, minutes=30 * i), f"1-{day}-{i}")
    for day in range(3):
        for i in range(20):
            rows += _traj("v0002", float(i % 5 != 0), MON + dt.timedelta(days=14 + day, hours=8, minutes=30 * i),
                          f"2-{day}-{i}")
    return rows


def test_a_weekly_shape_is_found_and_each_version_meets_its_predecessor_on_the_same_days(tmp_path):
    write(tmp_path, _weekly_world())
    table = by_version(str(tmp_path))
    assert table.shape.shaped and table.shape.p < 0.01 and table.shape.versions == 2
    s = _by_key(table)
    v1, v2 = s[("v0001", ALL)], s[("v0002", ALL)]
    assert v1.mean == pytest.approx((10 * 0.8 + 4 * 0.3) / 14) and v2.mean == pytest.approx(0.8)
    # without published.json: v0002 served from its first to its last call, Monday to Wednesday
    assert v2.served.source == "calls" and v2.served.since == MON + dt.timedelta(days=14, hours=8)
    assert {h // 24 for h in v2.served.hours} == {0, 1, 2}
    m = v2.matched
    assert (m.version, v2.baseline) == ("v0001", "v0001")
    assert m.trajectories == 2 * 3 * 20 and m.mean == pytest.approx(0.8)  # both Mondays-Wednesdays, no weekend
    assert s[("v0002", "writer")].matched.mean == pytest.approx(0.8)
    assert v1.matched is None  # its predecessor (the base) served nothing
    text = "\n".join(lines(table))
    assert text.startswith("weekly shape: yes")
    assert "v0001 over the same hours of the week: 120 trajs, 120 rated   success 0.800" in text
    # from published.json: the same hours, its window by the publisher's clock
    ck = tmp_path / "ck"
    _registry(ck, ("v0001", MON), ("v0002", MON + dt.timedelta(days=14)))
    t2 = _by_key(by_version(str(tmp_path), checkpoints=str(ck)))[("v0002", ALL)]
    assert t2.served.source == "published.json" and t2.served.since == MON + dt.timedelta(days=14)
    assert t2.served.until is None and t2.matched.mean == pytest.approx(0.8)


def test_flat_traffic_has_no_weekly_shape_and_no_matched_baseline(tmp_path):
    rows = []
    for day in range(14):
        for i in range(20):
            rows += _traj("v0001", float(i % 2), MON + dt.timedelta(days=day, hours=i), f"1-{day}-{i}")
    for i in range(40):
        rows += _traj("v0002", float(i % 4 != 0), MON + dt.timedelta(days=14, minutes=20 * i), f"2-{i}")
    write(tmp_path, rows)
    table = by_version(str(tmp_path))
    assert not table.shape.shaped and table.shape.p == pytest.approx(1.0)
    assert all(s.matched is None for s in table)
    assert lines(table)[0].startswith("weekly shape: not seen")


def test_chi_square_tail_and_too_little_data_to_tell():
    assert chi2_sf(3.841459, 1) == pytest.approx(0.05, abs=1e-5)
    assert chi2_sf(5.991465, 2) == pytest.approx(0.05, abs=1e-5)
    assert chi2_sf(16.918978, 9) == pytest.approx(0.05, abs=1e-5)
    assert chi2_sf(math.inf, 3) == 0.0 and chi2_sf(0.0, 3) == 1.0
    import polars as pl

    one_day = pl.DataFrame({"version": ["v0001"] * 50, "reward": [1.0, 0.0] * 25,
                            "start": [MON + dt.timedelta(minutes=i) for i in range(50)]})
    shape = weekly_shape(one_day)
    assert (shape.shaped, shape.df) == (False, 0) and "cannot tell" in shape.line()


# -- unknown and malformed versions ---------------------------------------------------------

def test_rewards_for_unknown_or_malformed_versions_are_counted_on_their_own(tmp_path):
    rows = []
    for i in range(40):
        rows += _traj("v0001", 1.0, MON + dt.timedelta(minutes=i), f"a{i}")
        rows += _traj(None, 0.0, MON + dt.timedelta(minutes=i), f"b{i}")
    for i in range(6):
        rows += _traj("v0099", 0.0, MON + dt.timedelta(hours=1, minutes=i), f"c{i}")  # nobody published v0099
        rows += _traj("v2-rc", 0.0, MON + dt.timedelta(hours=1, minutes=i), f"d{i}")  # not vNNNN
        rows += _traj("", 0.0, MON + dt.timedelta(hours=1, minutes=i), f"e{i}")  # empty: not the base either
    write(tmp_path, rows)
    ck = tmp_path / "ck"
    _registry(ck, ("v0001", MON - dt.timedelta(hours=1)))
    (ck / "v0001").mkdir()
    table = by_version(str(tmp_path), checkpoints=str(ck))
    s = _by_key(table)
    # nothing merged: v0001 and the base keep exactly their own trajectories
    assert (s[("v0001", ALL)].trajectories, s[("v0001", ALL)].mean) == (40, 1.0)
    assert (s[(BASE, ALL)].trajectories, s[(BASE, ALL)].mean) == (40, 0.0)
    for odd in ("v0099", "v2-rc", ""):
        assert (s[(odd, ALL)].calls, s[(odd, ALL)].trajectories, s[(odd, ALL)].rated) == (12, 6, 6)
    assert [x.version for x in table if x.agent == ALL] == [BASE, "v0001", "v0099", "", "v2-rc"]
    text = "\n".join(lines(table))
    assert "unknown: v0099 (served as 'agent@v0099') is not in published.json; counted on its own" in text
    assert "malformed version name 'v2-rc' (served as 'agent@v2-rc')" in text and "malformed version name ''" in text
    assert "unknown or malformed versions: v0099, '', 'v2-rc' (36 calls, 18 rated trajectories)" in text
    assert not s[("v0001", ALL)].tags
    # without published.json nothing can be called unknown, but a malformed name still is
    bare = _by_key(by_version(str(tmp_path)))
    assert not bare[("v0099", ALL)].tags and bare[("v2-rc", ALL)].tags[0].startswith("malformed")


# -- versions deleted from disk ------------------------------------------------------------

def test_a_version_deleted_from_disk_is_still_reported(tmp_path):
    rows = []
    for i in range(30):
        rows += _traj("v0001", 1.0, MON + dt.timedelta(minutes=i), f"a{i}")
        rows += _traj("v0002", 0.0, MON + dt.timedelta(days=1, minutes=i), f"b{i}")
    write(tmp_path, rows)
    ck = tmp_path / "ck"
    t2 = MON + dt.timedelta(days=1)
    _registry(ck, ("v0001", MON), ("v0002", t2), ("v0001", t2 + dt.timedelta(hours=2)),
              rollback_of={("v0001", t2 + dt.timedelta(hours=2)): "v0002"})
    (ck / "v0001").mkdir()  # v0002 was deleted
    s = _by_key(by_version(str(tmp_path), checkpoints=str(ck)))
    v2 = s[("v0002", ALL)]
    assert (v2.calls, v2.rated, v2.mean) == (60, 30, 0.0)
    assert v2.tags[0] == f"folder deleted: {ck}/v0002 is gone (figures from the transitions)"
    assert v2.tags[1] == "rolled back to v0001 at 2026-11-03T02:00"
    assert v2.served.since == t2 and v2.served.until == t2 + dt.timedelta(hours=2)
    assert not s[("v0001", ALL)].tags and s[("v0001", ALL)].served.until is None


def _checkpoints(tmp_path: Path, tool_adapter: Path, n: int) -> Path:
    ck = tmp_path / "ck"
    for i in range(1, n + 1):
        _copy_version(tool_adapter, ck, f"v{i:04d}")
    return ck


def _copy_version(tool_adapter: Path, ck: Path, v: str) -> None:
    shutil.copytree(tool_adapter, ck / v)
    man = json.loads((ck / v / "manifest.json").read_text())
    man["version"] = v
    (ck / v / "manifest.json").write_text(json.dumps(man))


def test_rollback_skips_a_deleted_version_or_refuses_leaving_everything_as_it_was(tmp_path, serve_factory,
                                                                                   tool_adapter):
    s = serve_factory(extra_args=["--max-lora-rank", "64"]).start()
    ck = _checkpoints(tmp_path, tool_adapter, 3)
    kw = dict(name="agent", stable_name="agent-live", keep=5)
    for v in ("v0001", "v0002", "v0003"):
        publish(str(ck / v), s.url, **kw)
    shutil.rmtree(ck / "v0001")
    shutil.rmtree(ck / "v0002")
    before, models = (ck / "published.json").read_text(), s.models()
    with pytest.raises(PublishError) as e:
        rollback(str(ck), s.url, **kw)
    assert f"{ck}/v0002" in str(e.value) and f"{ck}/v0001" in str(e.value) and "deleted" in str(e.value)
    assert (ck / "published.json").read_text() == before  # the registry as it was
    after = s.models()
    assert after.keys() == models.keys() and after["agent-live"]["root"] == models["agent-live"]["root"]
    # v0001 back on disk, v0002 still gone: the rollback skips to v0001
    _copy_version(tool_adapter, ck, "v0001")
    res = rollback(str(ck), s.url, **kw)
    assert (res.version, res.rollback_of) == ("v0001", "v0003")
    now = registry.current(str(ck))
    assert (now["version"], now["rollback_of"]) == ("v0001", "v0003")
    assert s.models()["agent-live"]["root"] == str((ck / "v0001").resolve())


# -- clock skew ----------------------------------------------------------------------------

def test_clock_skew_moves_neither_attribution_nor_served_since(tmp_path):
    t2 = MON + dt.timedelta(days=1)  # v0002 published Tuesday 00:00
    rows = []
    for i in range(300):
        rows += _traj("v0001", 1.0, MON + dt.timedelta(minutes=4 * i), f"a{i}")
        rows += _traj("v0002", 0.0, t2 + dt.timedelta(hours=1, minutes=4 * i), f"b{i}")
    # an agent host 6 hours behind: its v0002 calls are stamped while v0001 was serving
    for i in range(2):
        rows += _traj("v0002", 0.0, t2 - dt.timedelta(hours=5, minutes=i), f"behind{i}")
    # and one 9 hours ahead, still on v0001 (pinned to it), stamped in v0002's time
    for i in range(2):
        rows += _traj("v0001", 1.0, t2 + dt.timedelta(hours=9, minutes=i), f"ahead{i}")
    write(tmp_path, rows)
    s = _by_key(by_version(str(tmp_path)))
    v1, v2 = s[("v0001", ALL)], s[("v0002", ALL)]
    assert (v1.trajectories, v1.mean) == (302, 1.0) and (v2.trajectories, v2.mean) == (302, 0.0)  # by version
    # without published.json: the trimmed first and last calls, minutes from the true ones, not hours
    assert dt.timedelta(0) <= v2.served.since - (t2 + dt.timedelta(hours=1)) <= dt.timedelta(minutes=8)
    assert dt.timedelta(0) <= MON + dt.timedelta(minutes=4 * 299) - v1.served.until <= dt.timedelta(minutes=8)
    ck = tmp_path / "ck"
    _registry(ck, ("v0001", MON - dt.timedelta(hours=1)), ("v0002", t2))
    s = _by_key(by_version(str(tmp_path), checkpoints=str(ck)))
    assert s[("v0002", ALL)].served.since == t2 and s[("v0001", ALL)].served.until == t2
    assert s[("v0002", ALL)].trajectories == 302


# -- NaN, inf and unrated ------------------------------------------------------------------

def test_nan_inf_and_unrated_trajectories_are_left_out_of_the_mean_and_counted(tmp_path):
    rows = []
    for i in range(40):
        rows += _traj("v0001", 0.5 + 0.01 * (i % 3), MON + dt.timedelta(minutes=i), f"a{i}")
    for i, r in enumerate((math.nan, math.inf, -math.inf)):
        rows += _traj("v0001", r, MON + dt.timedelta(hours=1, minutes=i), f"bad{i}")
    rows += _traj("v0001", [0.9, math.nan], MON + dt.timedelta(hours=2), "nan-last")  # not the earlier 0.9
    for i in range(4):
        rows += _traj("v0001", None, MON + dt.timedelta(hours=3, minutes=i), f"unrated{i}")
    write(tmp_path, rows)
    v1 = _by_key(by_version(str(tmp_path)))[("v0001", ALL)]
    finite = [0.5 + 0.01 * (i % 3) for i in range(40)]
    assert (v1.trajectories, v1.rated, v1.nonfinite) == (48, 40, 4)
    assert v1.mean == pytest.approx(sum(finite) / 40) and math.isfinite(v1.low) and math.isfinite(v1.high)
    text = "\n".join(lines(by_version(str(tmp_path))))
    assert "left out of the mean: 4 unrated, 4 with a NaN/inf reward (trajectories)" in text
    assert sorted(rewards_of(trajectory_rewards(calls(str(tmp_path))), "v0001")) == sorted(finite)  # the watch too


def test_the_versions_command_prints_it(tmp_path):
    write(tmp_path, _weekly_world() + _traj("v2-rc", 1.0, MON, "odd"))
    p = subprocess.run([sys.executable, "-m", "nightshift.cli", "versions", "--data", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("weekly shape: yes") and "v0001 over the same hours of the week" in p.stdout
    assert "malformed version name 'v2-rc'" in p.stdout


# -- the nightly report's panel ------------------------------------------------------------

def test_the_report_plots_reward_by_version_marking_rollbacks_and_too_few(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from nightshift.nightly import report

    rows = []
    for i in range(40):
        rows += _traj("v0001", float(i % 4 != 0), MON + dt.timedelta(minutes=i), f"a{i}")
        rows += _traj("v0002", float(i % 4 == 0), MON + dt.timedelta(days=1, minutes=i), f"b{i}")
    for i in range(5):
        rows += _traj("v0003", 1.0, MON + dt.timedelta(days=2, minutes=i), f"c{i}")
    write(tmp_path / "data", rows)
    ck = tmp_path / "ck"
    t = [MON + dt.timedelta(days=d) for d in (0, 1, 2)]
    _registry(ck, ("v0001", t[0]), ("v0002", t[1]), ("v0003", t[2]))
    (ck / "gate-log.jsonl").write_text(json.dumps({"kind": "gate", "candidate": "v0003"}) + "\n" + json.dumps(
        {"kind": "watch", "candidate": "v0002", "baseline": "v0001", "decision": "worse", "p_value": 0.003,
         "rolled_back_to": "v0001"}) + "\n")
    assert report.rolled_back(str(ck)) == {"v0002": "rolled back: watch, p 0.003"}
    stats = by_version(str(tmp_path / "data"), checkpoints=str(ck))
    fig, ax = plt.subplots()
    report._plot_versions(ax, stats, report.rolled_back(str(ck)))
    ticks = [x.get_text() for x in ax.get_xticklabels()]
    assert ticks == ["v0001\n40 rated", "v0002\n40 rated\nrolled back", "v0003\n5 rated"]
    assert ax.get_xticklabels()[1].get_color() == "tab:red"
    assert len(ax.containers) == 2  # error bars for v0001 and v0002 only
    hollow = [ln for ln in ax.lines if ln.get_markerfacecolor() == "white" and ln.get_xdata().size]
    assert len(hollow) == 1 and hollow[0].get_xdata()[0] == pytest.approx(2)  # v0003: too few, no bar
    plt.close(fig)
    md, png = report.write({"run_id": "2026-11-05T02:15:00+00:00", "outcome": "x"}, [], str(tmp_path / "data"),
                           tmp_path / "reports", checkpoints=str(ck))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## Reward by version" in md.read_text() and "served 2026-11-03 00:00 - 2026-11-04 00:00" in md.read_text()
    # no transitions yet: the panel says so, nothing raises
    empty, _ = report.write({"run_id": "r0", "outcome": "x"}, [], str(tmp_path / "none"), tmp_path / "r0")
    assert "## Reward by version" not in empty.read_text()


def test_nothing_built_yet_is_said_not_a_traceback(tmp_path):
    ck = tmp_path / "ck"
    registry.append(str(ck), {"version": "v0001", "name": "agent@v0001", "endpoint": "http://127.0.0.1:9",
                              "mode": "lora", "path": "/x", "checkpoint": str(ck / "v0001")})
    registry.append(str(ck), {"version": "v0002", "name": "agent@v0002", "endpoint": "http://127.0.0.1:9",
                              "mode": "lora", "path": "/y", "checkpoint": str(ck / "v0002")})
    for args in (["versions", "--data", str(tmp_path / "data")],
                 ["watch", "--data", str(tmp_path / "data"), "--checkpoints", str(ck), "--vllm-url",
                  "http://127.0.0.1:9", "--name", "agent"]):
        p = subprocess.run([sys.executable, "-m", "nightshift.cli", *args], capture_output=True, text=True, timeout=120)
        assert "Traceback" not in p.stderr, p.stderr
        assert "no transitions under" in p.stdout + p.stderr and "nightshift build" in p.stdout + p.stderr
    assert p.returncode == 0 and "nothing to judge v0002 by" in p.stdout  # the watch waits; nothing rolled back
    assert registry.current(str(ck))["version"] == "v0002"
