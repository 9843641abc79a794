"""Issue 28 item 3: the local cluster a Ray build starts for itself, and a running
cluster it joins at an address. test_transform_ray.py runs its builds on the test's
own `ray.init`, which the engine uses as it is; these run with no cluster up (a
module of their own: the other module's cluster is gone by then).

The local cluster is the build's fixed cost, paid again by every build: on a 2-core
machine Ray's processes that a build does not use (the autoscaler's monitor, the log
monitor, the dashboard's API server, which ray.init waits for) took about two
CPU-seconds from the workers, so the engine starts the head without them. Two clusters start
here, a few seconds each."""

from __future__ import annotations

import operator
import os
import threading
import time

import psutil
import pytest
import ray

from nightshift.transform import build as B
from nightshift.transform import distributed
from nightshift.transform.config import BuildConfig
from test_transform_ray import cfg, mirror, same
from traces import T0, agent_run, write_spans

S = 10**9


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch):
    """No cluster up before (the engine would use it), none left after."""
    assert not ray.is_initialized()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield
    if ray.is_initialized():
        ray.shutdown()


def ray_processes() -> dict[str, int]:
    """This process's Ray children by kind (raylet, gcs_server, log_monitor, monitor, ...)."""
    out: dict[str, int] = {}
    for p in psutil.Process().children(recursive=True):
        try:
            line = " ".join(p.cmdline())
        except psutil.Error:
            continue
        for kind in ("gcs_server", "raylet/raylet", "log_monitor.py", "autoscaler/_private/monitor.py",
                     "dashboard/dashboard.py"):
            if kind in line:
                out[kind] = out.get(kind, 0) + 1
    return out


def agents(since: float) -> list[int]:
    """The raylet's agents started since `since`, wherever they are now: a raylet
    killed outright leaves them running, children of init, not of this process."""
    out = []
    for p in psutil.process_iter(["cmdline", "create_time", "status"]):
        line = " ".join(p.info["cmdline"] or [])
        if p.info["create_time"] >= since and p.info["status"] != psutil.STATUS_ZOMBIE and (
                "DashboardAgent" in line or "RuntimeEnvAgent" in line or "dashboard/agent.py" in line):
            out.append(p.pid)
    return out


def gone(since: float, kinds=("gcs_server", "raylet/raylet"), within: float = 10.0) -> bool:
    """The cluster's processes have all exited, its agents too."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not set(kinds) & set(ray_processes()) and not agents(since):
            return True
        time.sleep(0.1)
    return False


def test_a_local_cluster_has_the_processes_a_build_uses_and_is_stopped_after(monkeypatch):
    since = time.time() - 1
    settings = BuildConfig(engine="ray", workers=2)
    stopped_in = []
    events = "RAY_task_events_report_interval_ms"
    monkeypatch.delenv(events, raising=False)
    tests = os.path.dirname(os.path.abspath(__file__))  # the workers import ray_together from here
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([tests] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    with distributed.Engine(settings) as engine:
        running = ray_processes()
        assert engine.cpus == 2
        assert engine.run(operator.add, [1, 2, 3], 10) == [11, 12, 13]  # on the workers, results in order
        # no task events (nobody reads a build's own cluster's state API; the stop waited for them)...
        assert engine.run(os.getenv, [events], "unset") == ["0"]
        assert os.environ.get(events) is None  # ...and the driver's environment as it was
        # idle workers kept: a spread round's extra process waits out the advantages (Engine.prestart)
        assert engine.run(os.getenv, ["RAY_idle_worker_killing_time_threshold_ms"], "unset") == [str(distributed.IDLE_MS)]
        # each worker imported the build's modules as it started, not on its first task of them (preload)
        import ray_together

        assert [there for there, _ in engine.run(ray_together.has, [0, 1], (distributed.PRELOAD, 0.0))] == [True, True]
        stop = engine._stop
        engine._stop = lambda: (stopped_in.append(threading.current_thread()), stop())
        engine.release()  # the last round done: the cluster stops while the driver commits
        engine.release()  # once
    # stopped beside the driver (0.4 s after every build's last task), and waited for on the way out
    assert len(stopped_in) == 1 and stopped_in[0] is not threading.main_thread()
    assert running.get("gcs_server") == 1 and running.get("raylet/raylet") == 1
    # nothing scales a build's own cluster, nothing forwards its workers' output, nobody looks at a dashboard
    assert "log_monitor.py" not in running and "autoscaler/_private/monitor.py" not in running
    assert "dashboard/dashboard.py" not in running
    assert not ray.is_initialized() and gone(since)


def test_a_build_joins_a_running_cluster_at_its_address_and_leaves_it_running(tmp_path):
    """build.ray_address (RAY_ADDRESS likewise): the build's buckets run there, the
    rows are those of a build in one process, and the cluster is someone else's: the
    build disconnects and leaves it up."""
    data = tmp_path / "data"
    traces = [agent_run(f"join-{i}", i, calls=1, task=f"task {i % 3}", reward=float(i % 2), answer="answer")
              for i in range(12)]
    write_spans(str(data), traces)
    on_ray = mirror(data, tmp_path / "ray")
    now = T0 + 3600 * S
    since = time.time() - 1
    node = distributed._head(2)
    try:
        c = cfg(on_ray, "ray")
        c.build.ray_address = node.address
        remote = B.build(c, now_ns=now)
        assert remote.workers and not ray.is_initialized()
        assert all(p.process.poll() is None for ps in node.all_processes.values() for p in ps)  # still up
    finally:
        node.kill_all_processes(check_alive=False, allow_graceful=True)  # SIGKILL would orphan its agents
    local = B.build(cfg(data, "local"), now_ns=now)
    assert local.transitions == remote.transitions == 12
    same(data, on_ray)
    assert gone(since)
    assert os.environ.get("RAY_ADDRESS") is None
