"""Prometheus metrics of one routing proxy, in their own registry (served at
/metrics). Labels stay few: a route is a stable name in the table, `-` for a
request passed through untouched."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

OVERHEAD_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05)
GC_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.05)


class Children:
    """A labelled metric's children, each looked up once: prometheus_client's
    `labels()` takes a lock and checks its arguments on every call, and the request
    path asks for the same few (route, version, status) on every request. Holds no
    more than the metric itself does (it keeps every child it made)."""

    def __init__(self, metric) -> None:
        self.metric, self.known = metric, {}

    def __call__(self, *values: str):
        child = self.known.get(values)
        if child is None:
            child = self.known[values] = self.metric.labels(*values)
        return child


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("nightshift_route_requests", "Requests answered, by route, the version that answered "
                                "and the upstream's status (502/504: the proxy's own, upstream unreachable or silent).",
                                ["route", "version", "status"], registry=r)
        self.decisions = Counter("nightshift_route_decisions", "Routing decisions, by route, version, arm (serving, "
                                 "candidate) and what the sticky key was (header, trace, conversation, random).",
                                 ["route", "version", "arm", "key"], registry=r)
        self.fallbacks = Counter("nightshift_route_fallbacks", "Requests sent elsewhere because the upstream does not "
                                 "have the version chosen (missing), by route, that version and the one used instead.",
                                 ["route", "missing", "to"], registry=r)
        self.upstream_errors = Counter("nightshift_route_upstream_errors", "Upstream failures, by kind: connect "
                                       "(refused, unreachable: 502), tls (certificate not trusted, handshake failed: "
                                       "502), timeout (silent past read_timeout), broken (the connection dropped "
                                       "inside a response).", ["kind"], registry=r)
        self.refused = Counter("nightshift_route_refused", "Requests refused before the upstream, by status: 403 "
                               "(vLLM's admin API, or a control request for another host or from a browser page), 404 "
                               "(not an inference path), 405 (wrong method), 400 (a path, headers or a body the proxy "
                               "cannot pass on safely), 413 (past max_body_bytes).", ["status"], registry=r)
        self.stream_aborts = Counter("nightshift_route_stream_aborts", "Streamed responses cut off before their end, "
                                     "by who went away: upstream (the client's connection is aborted so it sees an "
                                     "error, never a short answer) or client (the upstream request is closed).",
                                     ["by"], registry=r)
        self.overhead = Histogram("nightshift_route_overhead_seconds", "Time the proxy itself spent on a request "
                                  "before the upstream had it and before the client had the upstream's headers.",
                                  buckets=OVERHEAD_BUCKETS, registry=r)
        self.inflight = Gauge("nightshift_route_requests_in_flight", "Requests being proxied.", registry=r)
        self.share = Gauge("nightshift_route_candidate_share", "The candidate's share of conversations, by route and "
                           "candidate (0 once a route has none).", ["route", "candidate"], registry=r)
        self.prompt_decisions = Counter("nightshift_route_prompt_decisions", "Requests a prompt route matched (their "
                                        "system prompt hashed to its id), by route (prompt:<id>), arm (candidate: the "
                                        "candidate's text put in; serving: the agent's own prompt) and sticky key.",
                                        ["route", "arm", "key"], registry=r)
        self.prompt_skipped = Counter("nightshift_route_prompt_skipped", "Requests on a prompt route's candidate arm "
                                      "passed through unchanged because their prompt could not be replaced without "
                                      "guessing, by route and reason.", ["route", "reason"], registry=r)
        self.prompt_unmarked = Counter("nightshift_route_prompt_unmarked", "Successful answers to a rewritten request "
                                       "whose `model` could not be marked with the prompt version (no `model` in the "
                                       "answer): their calls are attributed to the agent's own prompt.", registry=r)
        self.missing = Gauge("nightshift_route_missing_versions", "Versions the upstream said it does not have, "
                             "skipped for missing_ttl.", registry=r)
        self.gc_pauses = Histogram("nightshift_route_gc_pause_seconds", "The interpreter's collector passes in the "
                                   "proxy, by generation (wall time); one with streams in flight stalls them all "
                                   "(nightshift_route_gc_stall_seconds).",
                                   ["generation"], buckets=GC_BUCKETS, registry=r)
        self.gc_stalls = Histogram("nightshift_route_gc_stall_seconds", "The collector passes of "
                                   "nightshift_route_gc_pause_seconds taken with proxied requests in flight: the "
                                   "stall each of their streams felt (the proxy takes its passes when none is in "
                                   "flight, and at most one every few seconds otherwise).", buckets=GC_BUCKETS,
                                   registry=r)
        self.gc_passes = Counter("nightshift_route_gc_scheduled_passes", "Full collector passes the proxy took itself "
                                 "(its automatic collector is off while it serves), by why: idle (the last request "
                                 "in flight ended), gap (max_gap seconds of serving without one), "
                                 "growth (the tracked objects grew by max_growth).", ["why"], registry=r)

        # the request path's: children looked up once (Children)
        self.request, self.decision = Children(self.requests), Children(self.decisions)
        self.prompt_decision = Children(self.prompt_decisions)

    def gc_watcher(self, busy: Callable[[], int] = lambda: 0) -> Callable[[str, dict], None]:
        """A `gc.callbacks` entry timing each collector pass into `gc_pauses`, and into
        `gc_stalls` when `busy()` (the requests in flight) is not 0 as it starts. The
        p99 target is set by stalls felt by every stream at once, and a pass with
        streams in flight is one (1-5 ms measured at 200 streams): the benchmark
        reads them per phase, and an operator sees them beside the overhead histogram."""
        passes, start = [self.gc_pauses.labels(str(g)) for g in range(3)], [0.0, 0]

        def watch(phase: str, info: dict) -> None:
            if phase == "start":
                start[0], start[1] = time.perf_counter(), busy()
            else:
                took = time.perf_counter() - start[0]
                passes[info["generation"]].observe(took)
                if start[1]:
                    self.gc_stalls.observe(took)

        return watch

    def render(self) -> bytes:
        return generate_latest(self.registry)
