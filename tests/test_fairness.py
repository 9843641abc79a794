"""Per-client limits (collector/fairness.py) and how the transports answer them."""

from __future__ import annotations

import time

import grpc
import pytest

from nightshift.collector.errors import Overloaded, Throttled, wire_status
from nightshift.collector.fairness import MAX_CLIENTS, ClientLimits, peer_host


def test_in_flight_limit_is_per_client():
    lim = ClientLimits(max_inflight=2)
    lim.acquire("a")
    lim.acquire("a")
    with pytest.raises(Throttled):
        lim.acquire("a")
    lim.acquire("b")  # another client is not affected
    lim.release("a")
    lim.acquire("a")  # a slot came back


def test_byte_rate_goes_into_debt_and_says_how_long_to_wait():
    lim = ClientLimits(max_inflight=0, bytes_per_s=1000, burst_bytes=1000)
    lim.acquire("a")
    lim.charge("a", 5000)  # one request bigger than the burst still passes...
    lim.release("a")
    with pytest.raises(Throttled) as e:  # ...and the debt refuses the next one
        lim.acquire("a")
    assert 3.0 <= e.value.retry_after <= 4.1  # 4000 bytes of debt at 1000 bytes/s
    lim.acquire("b")


def test_debt_is_repaid_by_time():
    lim = ClientLimits(max_inflight=0, bytes_per_s=100_000, burst_bytes=1000)
    lim.acquire("a")
    lim.charge("a", 2000)
    lim.release("a")
    time.sleep(0.05)  # 5000 bytes of credit later
    lim.acquire("a")


def test_throttled_is_retryable_on_both_wires():
    st = wire_status(Throttled("x"))
    assert (st.http, st.grpc) == (429, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert isinstance(Throttled("x"), Overloaded)  # so it carries Retry-After / RetryInfo


def test_off_by_default_when_zero():
    lim = ClientLimits(max_inflight=0)
    for _ in range(1000):
        lim.acquire("a")
    assert not lim._clients


def test_idle_clients_are_forgotten_past_the_table_size():
    lim = ClientLimits(max_inflight=4)
    for i in range(MAX_CLIENTS + 10):
        lim.acquire(f"10.0.{i // 256}.{i % 256}")
        lim.release(f"10.0.{i // 256}.{i % 256}")
    assert len(lim._clients) <= MAX_CLIENTS


@pytest.mark.parametrize("peer,host", [
    ("ipv4:10.0.0.7:51234", "10.0.0.7"),
    ("ipv6:%5B::1%5D:51234", "::1"),
    ("ipv6:[2001:db8::1]:443", "2001:db8::1"),
    ("unix:/tmp/sock", "unix:/tmp/sock"),
])
def test_peer_host(peer, host):
    assert peer_host(peer) == host
