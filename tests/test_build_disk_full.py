"""`nightshift build` on a disk that fills: one sentence, exit 1, never a traceback,
and nothing lost: the dates committed before the failure stay readable, the build's
scratch is removed and the spans are untouched. Found by the 10M-span benchmark,
whose disk filled while the partitions were written (Arrow's OSError reached the
user as a traceback)."""

from __future__ import annotations

import errno

import polars as pl

from nightshift.cli.main import main
from nightshift.transform import output
from traces import T0, agent_run, write_spans

DAY = 86_400 * 10**9


def test_a_full_disk_is_one_sentence_and_keeps_what_was_committed(tmp_path, capsys, monkeypatch):
    data = tmp_path / "data"
    write_spans(str(data), [agent_run(f"a-{i}", i, calls=2, task="t", reward=1.0) for i in range(3)], batch="d1")
    write_spans(str(data), [agent_run(f"b-{i}", i, calls=2, task="t", reward=0.0) for i in range(3)], batch="d2",
                base_ns=T0 + DAY)
    spans = sorted(p.name for p in (data / "spans").rglob("*.parquet"))
    real, calls = output.write_partition, []

    def fills(*a, **k):
        calls.append(a[2])
        if len(calls) == 2:  # the second date: the disk is full
            raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")
        return real(*a, **k)

    monkeypatch.setattr(output, "write_partition", fills)
    code = main(["build", "--data", str(data), "--settle", "0", "--quiet"])
    out = capsys.readouterr()
    text = (out.out + out.err).strip()
    assert code == 1 and "Traceback" not in text and len(text.splitlines()) == 1, text
    assert "no space left on the device" in text and "build again" in text, text
    assert len(calls) == 2
    first = pl.read_parquet(data / "transitions" / f"date={calls[0]}" / "*.parquet")
    assert first.height == 6  # the date committed before the failure stays whole
    assert not (data / "transitions" / f"date={calls[1]}").exists()
    assert not list((data / "transitions").glob(".build-*"))  # scratch removed
    assert sorted(p.name for p in (data / "spans").rglob("*.parquet")) == spans
    monkeypatch.setattr(output, "write_partition", real)  # room again: the next build makes both dates
    assert main(["build", "--data", str(data), "--settle", "0", "--quiet"]) == 0
    assert sorted(p.name for p in (data / "transitions").glob("date=*")) == [f"date={d}" for d in sorted(calls)]
