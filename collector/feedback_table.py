"""Normalized feedback records (see `feedback`) to Arrow tables of the `feedback`
schema, and the one function that writes them to the dataset, used by both the
flusher and `nightshift feedback`."""

from __future__ import annotations

import pyarrow as pa

from nightshift.schemas import feedback as feedback_schema

from .datasets import DatasetStore, WriteStats
from .feedback import RECORD_KEYS


class FeedbackBuilder:
    """Rows gathered across WAL records or file rows, then one `table()`. Each row
    is partitioned by its arrival (`received_time`), never by the client's `time`,
    which may be missing or wrong."""

    def __init__(self) -> None:
        self.cols: dict[str, list] = {f.name: [] for f in feedback_schema.SCHEMA}
        self.dates: list[int] = []  # received_time in ns, for partitioning

    def __len__(self) -> int:
        return len(self.dates)

    def add(self, records: list[dict], received_ns: int, source: str) -> None:
        c = self.cols
        for r in records:
            for k in RECORD_KEYS:
                c[k].append(r[k])
            c["source"].append(source)
            c["received_time"].append(received_ns)
            self.dates.append(received_ns)

    def table(self) -> pa.Table:
        return pa.Table.from_arrays(
            [pa.array(self.cols[f.name], f.type) for f in feedback_schema.SCHEMA], schema=feedback_schema.SCHEMA
        )


def write_feedback(store: DatasetStore, batch_id: str, records: list[dict], received_ns: int, source: str) -> WriteStats:
    """Writes one batch of records to `<data>/feedback`, each `feedback_id` once per
    partition; a batch redone under the same id rewrites the same files."""
    b = FeedbackBuilder()
    b.add(records, received_ns, source)
    w = store.writer(feedback_schema.NAME, batch_id)
    try:
        w.add(b.table(), b.dates)
        return w.commit()
    except BaseException:
        w.abort()
        raise
