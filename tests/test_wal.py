"""The write-ahead log: durability point, group commit, crash recovery, cap, disk full."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest

from nightshift.collector import errors, wal
from nightshift.collector.wal import KIND_LOGS, KIND_TRACES, WriteAheadLog


def wait_for(cond, timeout: float = 20.0) -> None:
    """Waits until `cond()` holds (synchronization with the writer thread, not timing)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition never became true")
        time.sleep(0.005)


def records(directory: Path) -> list[tuple[int, int, bytes]]:
    out = []
    for p in wal.sealed_segments(directory):
        out += list(wal.read_segment(p))
    return out


@pytest.fixture
def open_wal(tmp_path):
    opened: list[WriteAheadLog] = []

    def make(**kw) -> WriteAheadLog:
        kw.setdefault("roll_interval", 3600.0)
        w = WriteAheadLog(tmp_path / "wal", **kw)
        w.open()
        opened.append(w)
        return w

    yield make
    for w in opened:
        if w._thread and w._thread.is_alive():
            w.close()


def test_append_close_read_round_trip(open_wal, tmp_path):
    w = open_wal()
    payloads = [b"first", b"", b"\x00\xff" * 1000, os.urandom(70_000)]
    w.append(KIND_TRACES, payloads[0], received_ns=111)
    w.append(KIND_LOGS, payloads[1], received_ns=222)
    w.append(KIND_TRACES, payloads[2], received_ns=333)
    w.append(wal.KIND_FEEDBACK, payloads[3], received_ns=444)
    w.close()
    segs = wal.sealed_segments(tmp_path / "wal")
    assert len(segs) == 1
    assert not list((tmp_path / "wal").glob("*" + wal.ACTIVE))
    assert list(wal.read_segment(segs[0])) == [
        (KIND_TRACES, 111, payloads[0]),
        (KIND_LOGS, 222, payloads[1]),
        (KIND_TRACES, 333, payloads[2]),
        (wal.KIND_FEEDBACK, 444, payloads[3]),
    ]
    data = segs[0].read_bytes()
    assert data.startswith(wal.MAGIC)
    assert wal._scan(data)[1] == len(data)  # nothing but whole records


def test_close_with_nothing_written_leaves_no_segment(open_wal, tmp_path):
    w = open_wal()
    w.close()
    assert list((tmp_path / "wal").glob("*" + wal.SEALED)) == []
    assert list((tmp_path / "wal").glob("*" + wal.ACTIVE)) == []


def test_append_after_close_is_refused(open_wal):
    w = open_wal()
    w.close()
    with pytest.raises(errors.Overloaded):
        w.append(KIND_TRACES, b"late")


def test_segments_roll_by_size_and_stay_in_order(open_wal, tmp_path):
    w = open_wal(segment_bytes=300)
    for i in range(20):
        w.append(KIND_TRACES, b"%03d" % i + b"." * 90)
    w.close()
    segs = wal.sealed_segments(tmp_path / "wal")
    assert len(segs) > 2
    ids = [wal.segment_id(p) for p in segs]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    got = [payload[:3] for _, _, payload in records(tmp_path / "wal")]
    assert got == [b"%03d" % i for i in range(20)]


def test_group_commit_many_threads(open_wal, tmp_path):
    w = open_wal()
    syncs: list[int] = []
    w.on_sync = lambda seconds, n: syncs.append(n)
    n_threads = 32
    barrier = threading.Barrier(n_threads)
    failures: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            barrier.wait()
            w.append(KIND_TRACES, b"thread-%02d" % i)
        except BaseException as e:  # noqa: BLE001
            failures.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    # every append returned only after a sync covering it
    assert sum(syncs) == n_threads
    # and requests arriving together shared fsyncs
    assert len(syncs) < n_threads
    assert max(syncs) > 1
    w.close()
    got = sorted(p for _, _, p in records(tmp_path / "wal"))
    assert got == sorted(b"thread-%02d" % i for i in range(n_threads))


def _segment_bytes(tmp_path, payloads) -> bytes:
    """The bytes of a cleanly written segment holding `payloads`."""
    d = tmp_path / "src"
    w = WriteAheadLog(d, roll_interval=3600)
    w.open()
    for i, p in enumerate(payloads):
        w.append(KIND_TRACES, p, received_ns=1000 + i)
    w.close()
    (seg,) = wal.sealed_segments(d)
    return seg.read_bytes()


@pytest.mark.parametrize(
    "tail",
    [
        b"\x01",  # a byte of a header
        b"\x10\x00\x00\x00\x00\x00",  # a partial header
        wal.encode_record(KIND_TRACES, 5, b"never acknowledged")[:-3],  # a record cut short
        b"\xff" * 40,  # garbage: a length pointing past the end
    ],
    ids=["one-byte", "partial-header", "partial-record", "garbage"],
)
def test_recovery_cuts_a_torn_tail(tmp_path, tail):
    payloads = [b"alpha", b"beta", b"gamma"]
    good = _segment_bytes(tmp_path, payloads)
    d = tmp_path / "wal"
    d.mkdir()
    crashed = d / f"{123:020d}{wal.ACTIVE}"
    crashed.write_bytes(good + tail)
    w = WriteAheadLog(d, roll_interval=3600)
    w.open()  # recovers
    assert not crashed.exists()
    sealed = d / f"{123:020d}{wal.SEALED}"
    assert sealed.exists()
    assert sealed.read_bytes() == good  # cut exactly at the last whole record
    assert [p for _, _, p in wal.read_segment(sealed)] == payloads
    # new segments get higher ids than the recovered one
    w.append(KIND_TRACES, b"after")
    w.close()
    segs = wal.sealed_segments(d)
    assert segs[0] == sealed
    assert [p for _, _, p in records(d)] == payloads + [b"after"]


def test_recovery_stops_at_a_corrupted_record(tmp_path):
    payloads = [b"one" * 10, b"two" * 10, b"three" * 10, b"four" * 10]
    good = bytearray(_segment_bytes(tmp_path, payloads))
    # flip a payload byte of the second record: its CRC no longer matches
    first_len = len(wal.encode_record(KIND_TRACES, 0, payloads[0]))
    second_payload_at = len(wal.MAGIC) + first_len + wal.HEADER.size
    assert good[second_payload_at : second_payload_at + 3] == b"two"
    good[second_payload_at] ^= 0x01
    d = tmp_path / "wal"
    d.mkdir()
    (d / f"{7:020d}{wal.ACTIVE}").write_bytes(bytes(good))
    assert wal.recover(d) >= 7
    (seg,) = wal.sealed_segments(d)
    assert [p for _, _, p in wal.read_segment(seg)] == [payloads[0]]
    assert seg.stat().st_size == len(wal.MAGIC) + first_len


def test_recovery_drops_an_active_segment_without_records(tmp_path):
    d = tmp_path / "wal"
    d.mkdir()
    (d / f"{5:020d}{wal.ACTIVE}").write_bytes(wal.MAGIC + b"\x03\x00")
    (d / f"{6:020d}{wal.ACTIVE}").write_bytes(b"")
    assert wal.recover(d) == 0
    assert list(d.iterdir()) == []


def test_read_segment_ignores_a_file_without_magic(tmp_path):
    p = tmp_path / f"{1:020d}{wal.SEALED}"
    p.write_bytes(b"NOTAWAL!" + wal.encode_record(KIND_TRACES, 1, b"x"))
    assert list(wal.read_segment(p)) == []


def test_cap_refuses_rolls_and_recovers_once_drained(open_wal, tmp_path):
    d = tmp_path / "wal"
    payload = b"p" * 100
    rec_len = len(wal.encode_record(KIND_TRACES, 1, payload))
    w = open_wal(cap_bytes=len(wal.MAGIC) + 2 * rec_len + rec_len // 2)
    w.append(KIND_TRACES, payload)
    w.append(KIND_TRACES, payload)
    with pytest.raises(errors.Overloaded) as exc:
        w.append(KIND_TRACES, payload)
    assert exc.value.retry_after > 0
    assert errors.wire_status(exc.value).http == 503
    # the active segment is handed over (sealed) so that a flusher can drain it
    wait_for(lambda: len(wal.sealed_segments(d)) == 1)
    (sealed,) = wal.sealed_segments(d)
    assert [p for _, _, p in wal.read_segment(sealed)] == [payload, payload]
    # still over the cap while the sealed segment is there
    with pytest.raises(errors.Overloaded):
        w.append(KIND_TRACES, payload)
    # the flusher deletes it: appends are accepted again
    sealed.unlink()
    w.append(KIND_TRACES, b"again")
    w.close()
    assert [p for _, _, p in records(d)] == [b"again"]


def test_a_single_record_bigger_than_the_cap_is_refused(open_wal):
    w = open_wal(cap_bytes=1000)
    with pytest.raises(errors.Overloaded):
        w.append(KIND_TRACES, b"x" * 2000)
    w.append(KIND_TRACES, b"small")  # the log itself is fine


def test_disk_full_is_retryable_and_leaves_no_partial_record(open_wal, tmp_path, monkeypatch):
    w = open_wal()
    w.append(KIND_TRACES, b"before")
    real_writev = os.writev
    state = {"armed": True, "calls": 0}

    def flaky_writev(fd, buffers):
        # the WAL's own descriptor only: first write half the bytes, then ENOSPC
        if fd == w._fd and state["armed"]:
            state["calls"] += 1
            if state["calls"] == 1:
                data = b"".join(bytes(b) for b in buffers)
                return os.write(fd, data[: len(data) // 2])
            state["armed"] = False
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_writev(fd, buffers)

    monkeypatch.setattr(wal.os, "writev", flaky_writev)
    with pytest.raises(errors.Overloaded) as exc:
        w.append(KIND_TRACES, b"refused" * 100)
    assert exc.value.retry_after > 0
    assert "No space" in str(exc.value) or "ENOSPC" in str(exc.value) or "28" in str(exc.value)
    assert state == {"armed": False, "calls": 2}
    w.append(KIND_TRACES, b"after")  # the disk has room again
    monkeypatch.undo()
    w.close()
    (seg,) = wal.sealed_segments(tmp_path / "wal")
    data = seg.read_bytes()
    assert [p for _, _, p in wal.read_segment(seg)] == [b"before", b"after"]
    assert wal._scan(data)[1] == len(data)  # no partial junk anywhere


def test_fsync_failure_is_retryable(open_wal, tmp_path, monkeypatch):
    w = open_wal()
    real = os.fdatasync
    state = {"armed": True}

    def failing(fd):
        if fd == w._fd and state["armed"]:
            state["armed"] = False
            raise OSError(errno.EIO, "I/O error")
        return real(fd)

    monkeypatch.setattr(wal.os, "fdatasync", failing)
    with pytest.raises(errors.Overloaded):
        w.append(KIND_TRACES, b"unsure")
    w.append(KIND_TRACES, b"ok")
    monkeypatch.undo()
    w.close()
    assert [p for _, _, p in records(tmp_path / "wal")] == [b"ok"]


def test_encode_record_layout():
    rec = wal.encode_record(KIND_LOGS, 42, b"payload")
    length, crc, kind, received = wal.HEADER.unpack_from(rec)
    assert (length, kind, received) == (7, KIND_LOGS, 42)
    assert rec[wal.HEADER.size :] == b"payload"
    records_, end = wal._scan(wal.MAGIC + rec)
    assert records_ == [(KIND_LOGS, 42, b"payload")] and end == len(wal.MAGIC) + len(rec)


def test_a_full_disk_when_starting_a_segment_is_survived(open_wal, tmp_path, monkeypatch):
    """A roll that cannot write the new segment's header (ENOSPC) used to kill the
    writer thread, and with it every later acknowledgement (found by the disk-full
    campaign, hardening/faults.py). Now: refused while full, accepted once not."""
    w = open_wal(segment_bytes=64)  # every append rolls; the first segment exists already
    real_write = os.write
    state = {"full": True, "refused": 0}

    def full_disk_write(fd, data):
        if state["full"] and bytes(data[:8]) == wal.MAGIC:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(wal.os, "write", full_disk_write)
    w.append(KIND_TRACES, b"first" * 20)  # fits in the open segment; the roll after it cannot start the next
    for _ in range(3):
        with pytest.raises(errors.Overloaded):
            w.append(KIND_TRACES, b"refused")
        state["refused"] += 1
    assert w._thread.is_alive()
    state["full"] = False  # space is back
    w.append(KIND_TRACES, b"second")
    monkeypatch.undo()
    w.close()
    assert [p for _, _, p in records(tmp_path / "wal")] == [b"first" * 20, b"second"]
    assert not list((tmp_path / "wal").glob("*.active"))


# --- a folder that goes away under a running log (issue 24) -------------------------------------------


def _gone(d: Path, how: str) -> None:
    if how == "deleted":
        import shutil

        shutil.rmtree(d)
    else:
        d.rename(d.with_name(d.name + ".old"))


@pytest.mark.parametrize("how", ["deleted", "moved"])
def test_a_folder_gone_under_the_log_is_never_acknowledged_into(open_wal, tmp_path, how):
    """Acknowledging into an unlinked file is acknowledging nothing: refused
    (retryable), then accepted again once the folder is back, with the records
    acknowledged before it went written back into it."""
    d = tmp_path / "wal"
    w = open_wal()
    w.append(KIND_TRACES, b"acknowledged before")
    _gone(d, how)
    with pytest.raises(errors.Overloaded) as exc:
        w.append(KIND_TRACES, b"refused")
    assert errors.wire_status(exc.value).http == 503 and exc.value.retry_after > 0
    assert "is gone" in str(exc.value) and str(d) in str(exc.value)
    assert w.lost
    with pytest.raises(errors.Overloaded):  # and every write after it, until it is back
        w.append(KIND_TRACES, b"refused too")
    d.mkdir()  # the operator's mkdir, or the volume remounted
    wait_for(lambda: not w.lost)
    w.append(KIND_TRACES, b"after")
    w.close()
    assert [p for _, _, p in records(d)] == [b"acknowledged before", b"after"]
    assert not list(d.glob("*" + wal.ACTIVE))


def test_a_folder_deleted_while_idle_is_noticed_and_close_keeps_what_was_acknowledged(open_wal, tmp_path):
    """No write needed to notice (health turns red on its own), and a shutdown with
    the folder still gone recreates it for the records only this process holds."""
    d = tmp_path / "wal"
    w = open_wal()
    w.append(KIND_TRACES, b"one")
    w.append(KIND_LOGS, b"two")
    _gone(d, "deleted")
    wait_for(lambda: w.lost)
    w.close()  # used to raise FileNotFoundError
    assert [p for _, _, p in records(d)] == [b"one", b"two"]
    assert not list(d.glob("*" + wal.ACTIVE))


def test_a_folder_deleted_with_nothing_held_is_not_recreated_at_close(open_wal, tmp_path):
    d = tmp_path / "wal"
    w = open_wal()
    _gone(d, "deleted")
    wait_for(lambda: w.lost)
    w.close()
    assert not d.exists()


def test_a_lost_folder_taken_by_another_collector_stays_refused(tmp_path):
    import fcntl

    d = tmp_path / "wal"
    w = WriteAheadLog(d, roll_interval=3600, lock=True)
    w.open()
    try:
        w.append(KIND_TRACES, b"mine")
        _gone(d, "deleted")
        wait_for(lambda: w.lost)
        d.mkdir()
        with open(d / wal.LOCK, "a+") as other:  # another collector started on the new folder
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            wait_for(lambda: "another collector" in w.lost)
            with pytest.raises(errors.Overloaded, match="another collector took"):
                w.append(KIND_TRACES, b"refused")
        wait_for(lambda: not w.lost)  # released: this log's folder again
        w.append(KIND_TRACES, b"after")
    finally:
        w.close()
    assert [p for _, _, p in records(d)] == [b"mine", b"after"]
