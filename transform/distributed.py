"""Where a build's buckets run: one after another in this process, or as tasks on Ray.

A build splits its window into buckets of whole traces (`build`); each bucket is
built by the same function (`build.run_bucket`) from file paths (the spans stay in
the lake, or in the split's scratch files) and leaves its parts in the scratch
folder; the driver then pools the advantages and commits every partition, as a
build in one process does. So Ray changes where the buckets run, never what they
make: the rows are the same, row for row.

Ray, not Dask: a bucket is a coarse task of Python code (seconds to minutes, reading
its own files and writing its own parts), which is what Ray's task API schedules,
retries when a worker dies (`max_retries`) and spreads over a cluster with nothing
else to learn; Dask's strength, collections of dataframes, is not what a bucket is.

A local cluster is started for the build when no address is given (and torn down
after), with only the processes a build uses (`_head`: its start-up is every build's
fixed cost); `build.ray_address` (or RAY_ADDRESS, which Ray users set) joins a running
one. Every node must reach the data folder at the same path: the scratch parts go
beside the output (`<data>/transitions/.build-*`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import resource
import socket
import sys
import threading
import time
from typing import Callable, TypeVar

from nightshift.schemas.layout import LayoutError

log = logging.getLogger("nightshift.transform")

J = TypeVar("J")
D = TypeVar("D")

#: Retries of a bucket whose worker died (killed, out of memory, node lost): each
#: attempt rewrites the bucket's parts whole, so a retry leaves what one attempt would.
RETRIES = 3
PIN = "ray==2.60.0"


class EngineError(RuntimeError):
    """Ray asked for and not installed, or its cluster not reachable (one sentence)."""


class Engine:
    """Runs `work(job, shared)` for each job, results in the jobs' order: in this
    process, or as Ray tasks on a cluster joined (or started) for the engine's life,
    so a build's several rounds of tasks (split, buckets, partitions) share it."""

    def __init__(self, settings) -> None:
        self.settings = settings
        self.remote = settings.engine == "ray"
        self.cpus = 1  # how many jobs run at once
        #: Ray worker process -> [CPU-seconds of its tasks, its peak RSS in bytes]: what each worker did,
        #: in CPU-seconds, which other processes on a shared machine do not inflate as they do wall time
        self.usage: dict[str, list[float]] = {}
        #: each Ray round's work (its function's name) and idle worker-seconds (`_on_ray`): where a round
        #: waits on one worker (a tail, a late process), which CPU-seconds do not show
        self.idle: list[tuple[str, float]] = []
        self._stop: Callable[[], None] | None = None  # set when this engine started (or joined) the cluster
        self._armed: tuple[str, int] | None = None  # Engine.prestart's module and processes, till fired
        self._warming: list | None = None  # the fired prestart's tasks
        self._stopping: threading.Thread | None = None  # Engine.release's

    def __enter__(self) -> "Engine":
        if self.remote:
            self._stop = _init(self.settings)
            import ray

            self.cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        return self

    def __exit__(self, *exc) -> None:
        self._armed = None
        if self.remote and self._warming is not None:
            self._warmed()
        if self._stop is not None:
            self._stop()
            self._stop = None
        if self._stopping is not None:
            self._stopping.join()
            self._stopping = None

    def release(self) -> None:
        """No task after this: the cluster this engine started (or joined) is left in
        a thread while the driver commits and removes its scratch, and `__exit__`
        waits for it. Stopping a local cluster is the driver's: the raylet, the GCS
        and the agents told to stop and waited for, 0.4 s after the last task of every
        build, with the workers idle."""
        self._armed = None
        if self._stop is None or self._stopping is not None:
            return
        if self._warming is not None:
            self._warmed()
        stop, self._stop = self._stop, None

        def leave() -> None:
            try:
                stop()
            except Exception as e:  # the build's rows are made: a cluster that stops badly is only said
                log.warning("stopping the Ray cluster: %s", e)

        self._stopping = threading.Thread(target=leave, name="nightshift-ray-stop")
        self._stopping.start()

    def run(self, work: Callable[[J, object], D], jobs: list[J], shared: object = None,
            tick: Callable[[], None] = lambda: None, spread: bool = False,
            weights: list[int] | None = None, each: Callable[[int], None] | None = None) -> list[D]:
        """`spread`: jobs that cannot be cut finer (a date's partition is one file)
        run all at once when there are fewer than two per CPU, each with its share of
        the CPUs, so the cores are shared to the end of the round instead of one job
        running alone after the others: three dates on two workers were two rounds,
        one of them on one core. Not for jobs sized to a worker's memory.

        `weights` (a job's bytes, say): on Ray the heaviest job is handed out first
        (`order`), so the round ends on light ones and the workers finish together,
        and in a spread round the worker process started last (its imports a second
        behind the others) gets the lightest: a window's last date is often a
        part of a day. Results come back in the jobs' order whatever the order run.

        `each(i)`: in the driver as job i's result comes in, while the others run (a
        job done is never retried: its inputs can go)."""
        each = each or (lambda i: None)
        if not self.remote:
            out = []
            for i, job in enumerate(jobs):
                out.append(work(job, shared))
                each(i)
                tick()
            return out
        warming, self._warming = self._warming, None  # fired in the round before: for this round's last tasks
        armed, self._armed = self._armed, None  # this round's tail starts the next round's processes

        def tail(left: int) -> None:  # after each result, `left` tasks unfinished
            nonlocal armed
            if armed is not None and left >= self.cpus:  # its first result: every worker on a task still
                self._warming, armed = _fire(*armed), None

        return _on_ray(work, jobs, shared, tick, self.usage, share(self.cpus, len(jobs)) if spread else 1.0,
                       order(weights) if weights is not None else None, each,
                       tail, len(warming) if warming else 0, lambda: _release(warming), self.idle, self.cpus)


    def prestart(self, module: str, jobs: int) -> None:
        """Called before the round that comes before a spread round of `jobs` (the
        buckets, before the dates): the processes the spread round needs beyond one
        per CPU are started during that round and wait for it, idle, the build's
        modules imported.

        A spread round on two CPUs runs three tasks, and Ray starts the third process
        only when the round is handed out. Started while the driver pooled the
        advantages (ray6), the two warm workers waited for it to meet them (1.2 s at
        load 13, the round's first tasks that late) and its date still started 2.4 s
        after theirs. Now a task of no CPU goes out at the previous round's first
        result, every worker on a task still, so Ray starts a process for it (or, had
        a worker just come free, for the task it put off); the process imports the
        build's modules as it starts (`preload`) and stays (`LEAN`: Ray stops an idle
        process beyond one per CPU after a second, and the warm ones with it). Its
        start is the same CPU whenever it comes; idle, it holds its imports' memory
        (about 300 MiB) through that round. The spread round's heaviest tasks go to
        the warm workers at once, its last ones once the task of no CPU is done. A
        previous round with no more tasks than CPUs: Ray starts the process with
        the spread round, as before. On one machine only: on several, Ray may start
        it on a machine the round's tasks do not go to."""
        if not self.remote or share(self.cpus, jobs) == 1.0:
            return
        import ray

        if len(ray.nodes()) != 1:
            return
        self._armed = (module, jobs - self.cpus)

    def _warmed(self) -> None:
        """A fired prestart whose round never came (the build failed): its tasks done
        before the cluster stops."""
        warming, self._warming = self._warming, None
        _release(warming)


def _fire(module: str, processes: int) -> list:
    """`processes` new worker processes, each importing `module` (`_warm`)."""
    import ray

    task = ray.remote(num_cpus=0, max_retries=0)(_warm)
    return [task.remote(module) for _ in range(processes)]


def _release(warming: list | None) -> None:
    """Wait (PATIENCE at most) for the prestarted processes to be done importing, so
    that Ray hands the round's held tasks to them, idle, and starts no process of
    its own for them; the round's other tasks are running meanwhile."""
    if warming:
        import ray

        ray.wait(warming, num_returns=len(warming), timeout=PATIENCE)


#: How long the driver waits for a prestarted process still starting when the round that needs it is
#: handed out (`_release`): a process starts in about a second; past this the held tasks go out anyway
PATIENCE = 3.0


def _warm(module: str) -> int:
    """Import `module` (a process started for this has it already: `preload`)."""
    import importlib

    importlib.import_module(module)
    return os.getpid()


def _reachable(address: str) -> str:
    """'' when something listens at a host:port address, else why not: Ray itself
    retries an unreachable address for minutes before it says so."""
    if address in ("auto", "local"):
        return ""
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return f"it is not host:port, ray://host:port or auto (got {address!r})"
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            return ""
    except OSError as e:
        return f"nothing answers at {host}:{port} ({e.strerror or e})"


def check(settings) -> None:
    """Before a build reads anything: Ray installed, its cluster reachable (one
    sentence, EngineError, when not)."""
    if settings.engine != "ray":
        return
    try:
        import ray
    except ImportError:
        raise EngineError(f"build.engine is ray, but Ray is not installed in this Python ({sys.executable}): "
                          f"pip install 'nightshift-rl[distributed]' (or {PIN})") from None
    address = settings.ray_address or os.environ.get("RAY_ADDRESS", "")
    if address and not ray.is_initialized():
        why = _reachable(address)
        if why:
            raise EngineError(f"cannot reach the Ray cluster at {address}: {why}")


def _init(settings) -> Callable[[], None] | None:
    """Connect to (or start) the cluster; how to leave it when this build did either,
    None when a caller's own ray.init is used as it is."""
    check(settings)
    import ray

    if ray.is_initialized():  # a caller's own ray.init (a notebook, a test): use it as it is
        return None
    address = settings.ray_address or os.environ.get("RAY_ADDRESS", "")
    try:
        if address:
            ray.init(address=address, logging_level=logging.WARNING)
            return ray.shutdown
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a cluster of this machine for one build: no sign-in
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing to report from a build's own cluster
        cpus = settings.workers or os.cpu_count() or 1
        with _env_defaults(LEAN):  # the cluster's processes and this driver read them as they start
            try:
                node = _head(cpus)
            except (ImportError, AttributeError, TypeError):  # Ray's internals moved: its own start, all its processes
                ray.init(num_cpus=cpus, include_dashboard=False, object_store_memory=OBJECT_STORE,
                         logging_level=logging.WARNING, log_to_driver=False)
                return ray.shutdown
            try:
                ray.init(address=node.address, logging_level=logging.WARNING, log_to_driver=False)
            except BaseException:
                node.kill_all_processes(check_alive=False, allow_graceful=True)  # SIGKILL orphans the raylet's agents
                raise
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise EngineError(f"cannot start or join the Ray cluster{' at ' + address if address else ''}: {e}") from None

    def stop() -> None:
        ray.shutdown()  # the driver leaves; the processes are the node's to stop
        node.kill_all_processes(check_alive=False, allow_graceful=True)

    return stop


#: The local cluster's object store: tasks get paths and return small summaries, parts go through files
OBJECT_STORE = 128 << 20

#: How long an idle worker process lives beyond one per CPU on a build's own cluster (Ray: a second): a
#: spread round's extra process is started in the round before (`Engine.prestart`) and waits out the
#: driver's advantages, and so do the warm workers idle in the buckets' tail; with a second, Ray stopped
#: one of the three (tests/test_transform_ray.py, 1.5 s between the rounds: the round had two processes)
IDLE_MS = 600_000

#: Ray's settings for a build's own cluster, where not set already. No task events: every worker sends
#: its tasks' to the GCS for the state API and the dashboard, which nobody reads on a build's own
#: cluster, and the driver flushes its own on the way out: the cluster's stop took 0.12 s median
#: without them against 0.36 s with (7 pairs alternating, load 4-8). Set it (to 1000) to profile a
#: build with `ray.timeline()`. Idle workers kept (IDLE_MS); each imports the build's modules as it starts
#: (`preload`).
LEAN = {"RAY_task_events_report_interval_ms": "0", "RAY_idle_worker_killing_time_threshold_ms": str(IDLE_MS),
        "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR": "nightshift.transform.distributed.preload"}

#: What every worker of a build's own cluster imports as it starts (`preload`): the module of the build's tasks
PRELOAD = "nightshift.transform.build"


def preload() -> None:
    """Run by each worker process of a build's own cluster as it starts (Ray's
    worker setup hook, `runtime_env={"worker_process_setup_hook": ...}`, which a
    worker reads from its environment, LEAN): the build's modules imported then,
    not on its first task. A process Ray starts in a round for a task of another
    (`Engine.prestart`'s) sat idle without them and imported them on the spread
    round's date (2.4-3.4 s late at load 13); the first workers import them while
    the driver is still joining the cluster, not when the split begins."""
    import importlib

    importlib.import_module(PRELOAD)



@contextlib.contextmanager
def _env_defaults(values: dict[str, str]):
    """`values` in this process's environment, where not set already, while the
    cluster starts (its processes inherit them), then as they were: a later
    `ray.init` of the caller's own is not this build's."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _head(cpus: int):
    """A local cluster's head node with the processes a build uses and no others.

    `ray.init` also starts the autoscaler's monitor, the log monitor and the
    dashboard's API server (with include_dashboard=False it still runs, for usage
    statistics, and ray.init waits for it to answer): on a 2-core machine their
    start-up is a second or two of the build's wall time and a CPU-second taken from
    the workers, for a cluster that never scales, a driver that forwards no worker
    output (`log_to_driver=False`: a task's error comes back with its result) and
    nobody to look at a dashboard. Ray's own `Node` (pinned, PIN) starts the head
    without them; the raylet still starts its agents and waits for them. Not the
    node's exit hooks either (`shutdown_at_exit`: they replace the process's SIGTERM
    handler): the engine stops the node, and the kernel's fate-sharing (or Ray's
    reaper) stops it if this process dies."""
    import inspect

    from ray._private.node import Node
    from ray._private.parameter import RayParams

    if list(inspect.signature(Node.start_api_server).parameters) != ["self", "include_dashboard", "raise_on_failure"]:
        raise TypeError("Ray's Node.start_api_server changed")  # before any process starts: ray.init's way instead

    class Head(Node):
        def start_api_server(self, *, include_dashboard, raise_on_failure) -> None:
            self._webui_url = ""  # as Ray leaves it when the dashboard is not included

    params = RayParams(num_cpus=cpus, include_dashboard=False, object_store_memory=OBJECT_STORE,
                       include_log_monitor=False, no_monitor=True)
    return Head(params, head=True, shutdown_at_exit=False, spawn_reaper=True)


def _remote(work, job, shared):
    """A job in a Ray worker, with the worker, the task's CPU-seconds (its threads
    too), the worker's peak memory and the task's seconds, for the summary."""
    c0, t0 = time.process_time(), time.perf_counter()
    done = work(job, shared)
    return done, f"{socket.gethostname()}:{os.getpid()}", time.process_time() - c0, \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, time.perf_counter() - t0


def balance(weights: list[int], n: int) -> list[tuple[int, int]]:
    """`weights` (units in the order they must be read) as at most `n` contiguous
    runs [start, end) of about the same total: each cut falls where the running sum
    is nearest a multiple of total / n. A round's wall time is its busiest worker's,
    so runs of equal count were a tail: the benchmark's split, four runs of three
    files each (80, 80, 80 and 27 MB), gave one worker 427 MB and the other 374 and
    left it idle for the last eighth of the split. Runs stay contiguous because their
    pieces are read back in run order: each bucket gets its rows in the same order."""
    n = max(1, min(n, len(weights)))
    total = sum(weights)
    if not weights or not total:
        return [(len(weights) * k // n, len(weights) * (k + 1) // n) for k in range(n)] if weights else []
    sums = [0]
    for w in weights:
        sums.append(sums[-1] + w)
    cuts = [0]
    for k in range(1, n):
        goal = total * k / n
        at = cuts[-1] + 1
        while at < len(weights) - (n - k) and abs(sums[at + 1] - goal) <= abs(sums[at] - goal):
            at += 1  # the next unit brings the run nearer its goal
        cuts.append(at)
    cuts.append(len(weights))
    return list(zip(cuts, cuts[1:]))


def share(cpus: int, jobs: int) -> float:
    """CPUs per task for `jobs` tasks on `cpus` CPUs: 1, or, between one and two
    tasks per CPU, a share that lets them all run at once. Ray counts CPUs in
    ten-thousandths: rounded down, or the shares would add up to more than the CPUs."""
    if not cpus < jobs < 2 * cpus:
        return 1.0
    return math.floor(cpus * 10_000 / jobs) / 10_000


def order(weights: list[int]) -> list[int]:
    """The jobs' indexes, heaviest first (ties in the jobs' order): Ray hands a
    round's tasks to free workers in the order they were submitted."""
    return sorted(range(len(weights)), key=lambda i: -weights[i])


def _on_ray(work, jobs, shared, tick, usage: dict[str, list[float]], cpus: float = 1.0,
            first: list[int] | None = None, each: Callable[[int], None] = lambda i: None,
            tail: Callable[[int], None] = lambda left: None, held: int = 0, release: Callable[[], None] = lambda: None,
            rounds: list | None = None, total: int = 1):
    """`held`: the last (lightest) tasks submitted only once `release()` has
    found the processes started for them ready (`Engine.prestart`): submitted with
    the others, Ray would start processes of its own for them while those import.
    `rounds` gets the round's idle worker-seconds: its task slots (`total` CPUs /
    `cpus` each) times its wall time, less its tasks' seconds in the workers (a
    worker's imports before its first task, a late process, the round's tail)."""
    import ray

    rounds = [] if rounds is None else rounds
    t0, busy = time.perf_counter(), 0.0
    task = ray.remote(num_cpus=cpus, max_retries=RETRIES)(_remote)
    shared_ref = ray.put(shared)  # once: every task reads the same settings, feedback and log events
    ids = first if first is not None else list(range(len(jobs)))
    cut = max(len(ids) - held, 0)
    refs = {task.remote(work, jobs[i], shared_ref): i for i in ids[:cut]}
    release()
    refs.update({task.remote(work, jobs[i], shared_ref): i for i in ids[cut:]})
    out: list = [None] * len(jobs)
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        tail(len(pending))
        try:
            out[refs[ready[0]]], who, cpu, rss, took = ray.get(ready[0])
            busy += took
            mine = usage.setdefault(who, [0.0, 0])
            mine[0] += cpu
            mine[1] = max(mine[1], rss)
        except ray.exceptions.RayTaskError as e:  # the job's own error, as the local engine raises it
            if isinstance(e.cause, LayoutError):  # a file it cannot read: its one sentence, not the worker's traceback
                raise e.cause from None
            raise e.as_instanceof_cause() from None
        except ray.exceptions.RayError as e:  # its worker died more often than it was retried
            raise EngineError(f"task {refs[ready[0]] + 1} of {len(jobs)} failed on Ray after {RETRIES} retries "
                              f"({type(e).__name__}); nothing was committed: {str(e).splitlines()[0]}") from None
        each(refs[ready[0]])
        tick()
    rounds.append((getattr(work, "__name__", "tasks"), int(total / cpus + 1e-6) * (time.perf_counter() - t0) - busy))
    return out
