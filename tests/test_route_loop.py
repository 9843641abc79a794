"""The route's event loop (`route.loop`): uvloop when installed (its transports cost
the proxy 9 to 16 % less CPU per proxied request, benchmarks/route.py), asyncio's
own when asked or when uvloop cannot be had, and the start-up line says which runs;
asking for uvloop where it is missing is one sentence, not a traceback."""

from __future__ import annotations

import asyncio
import sys

import pytest
from test_route import route_factory  # noqa: F401  (the fixture: a real `nightshift route` process)

from nightshift.route.server import StartupError, loop_factory


def test_auto_takes_uvloop_when_installed_and_asyncio_otherwise(monkeypatch):
    uvloop = pytest.importorskip("uvloop")
    assert loop_factory("auto") == (uvloop.new_event_loop, f"uvloop {uvloop.__version__}")
    assert loop_factory("asyncio") == (asyncio.new_event_loop, "asyncio")
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed
    assert loop_factory("auto") == (asyncio.new_event_loop, "asyncio")
    with pytest.raises(StartupError, match="route.loop is uvloop but uvloop is not installed"):
        loop_factory("uvloop")


def test_the_start_up_line_names_the_loop_that_runs(tmp_path, route_factory):  # noqa: F811
    uvloop = pytest.importorskip("uvloop")
    fast = route_factory("http://127.0.0.1:9", state=tmp_path / "a.json").start()
    plain = route_factory("http://127.0.0.1:9", state=tmp_path / "b.json", extra=["--loop", "asyncio"]).start()
    assert f"event loop: uvloop {uvloop.__version__}" in fast.log()
    assert "event loop: asyncio" in plain.log()
    # an upstream that refuses the connection is still the proxy's clean 502 on either loop
    for r in (fast, plain):
        assert r.call("POST", "/v1/chat/completions", {"model": "m", "messages": []})[0] == 502
    assert fast.stop() == 0 and plain.stop() == 0
