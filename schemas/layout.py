"""Where each dataset lives under the data root, and the check every reader makes
of what it opens.

    <data>/spans/date=YYYY-MM-DD/part-<batch>.parquet      (the collector, one file a batch)
    <data>/logs/date=YYYY-MM-DD/part-<batch>.parquet
    <data>/feedback/date=YYYY-MM-DD/part-<batch>.parquet
    <data>/transitions/date=YYYY-MM-DD/part-0.parquet      (`nightshift build`, one file a date)

The folders are the datasets' `NAME`s and the partitions Hive's `key=value`, so
`pl.scan_parquet(files(data, "transitions"), hive_partitioning=True)` gives a user
the `date` column for free. Written here once, because a reader that spelled a path
by hand would go on reading it after the collector or the build moved on.

What a reader needs of a dataset is declared beside the dataset's schema (each
module's `READERS`: the columns without which that reader cannot read a row), and
`check` holds a file to it and to the schema versions this Nightshift reads. A lake
written by a newer Nightshift, or a folder a hand filled, is then one sentence that
names the file, the version found and the versions read, or the columns it lacks:
never a Polars `ColumnNotFoundError` three stages later, nor a column read with a
meaning it no longer has. A file without the version key (written by another tool)
is held to its columns only.

Standard library and pyarrow only: the collector's flusher imports this without Polars.
"""

from __future__ import annotations

from types import ModuleType
from typing import Iterable

import pyarrow as pa

from . import feedback, logs, spans, transitions
from .common import METADATA_NAME, METADATA_VERSION

DATASETS: dict[str, ModuleType] = {m.NAME: m for m in (spans, logs, feedback, transitions)}
#: The datasets' folder names under the data root, for the readers and writers that name one.
SPANS, LOGS, FEEDBACK, TRANSITIONS = spans.NAME, logs.NAME, feedback.NAME, transitions.NAME

#: The Hive partition key of every dataset: the UTC date its rows belong to.
PARTITION = "date"
SUFFIX = ".parquet"
#: The one file of a transitions partition (the build replaces a partition whole).
TRANSITIONS_FILE = "part-0" + SUFFIX

#: Who writes each dataset: what a reader's sentence tells the user to run again.
WRITTEN_BY = {spans.NAME: "nightshift collect", logs.NAME: "nightshift collect",
              feedback.NAME: "nightshift collect or nightshift feedback", transitions.NAME: "nightshift build"}


class LayoutError(ValueError):
    """A dataset a reader cannot read as it is: one sentence naming the file, for the
    command to print as it is and exit 2 (the data, not the code, is what is wrong)."""


def folder(root: str, dataset: str) -> str:
    """`<root>/<dataset>`: where a dataset's partitions are."""
    _known(dataset)
    return f"{root.rstrip('/')}/{dataset}"


def partition(date: str) -> str:
    """A partition folder's name: `date=YYYY-MM-DD`."""
    return f"{PARTITION}={date}"


def partition_folder(root: str, dataset: str, date: str) -> str:
    return f"{folder(root, dataset)}/{partition(date)}"


def file(root: str, dataset: str, date: str, name: str) -> str:
    """`<root>/<dataset>/date=<date>/<name>`: one file of a partition, by its listed name."""
    return f"{partition_folder(root, dataset, date)}/{name}"


def partition_date(name: str) -> str | None:
    """The date of a partition folder's name (its last path part), None for any
    other name: a reader lists a dataset's folder and skips what is not a partition."""
    last = name.rstrip("/").rsplit("/", 1)[-1]
    prefix = partition("")
    return last[len(prefix):] if last.startswith(prefix) else None


def date_of(path: str) -> str:
    """The date partition a file's path is in, "" when it is in none."""
    return next((d for d in map(partition_date, path.split("/")) if d is not None), "")


def batch_file(batch_id: str) -> str:
    """The collector's file for one batch: unique per batch, so a batch redone after
    a crash rewrites its own file and never another's."""
    return f"part-{batch_id}{SUFFIX}"


def files(root: str, dataset: str) -> str:
    """The glob of a dataset's files, for `pl.scan_parquet(..., hive_partitioning=True)`
    or `fs.glob`."""
    return f"{folder(root, dataset)}/**/*{SUFFIX}"


def _known(dataset: str) -> ModuleType:
    if dataset not in DATASETS:
        raise KeyError(f"no dataset {dataset!r} (known: {', '.join(DATASETS)})")
    return DATASETS[dataset]


def needs(dataset: str, reader: str) -> tuple[str, ...]:
    """The columns `reader` cannot do without in `dataset`, as declared beside its schema."""
    module = _known(dataset)
    try:
        return module.READERS[reader]
    except KeyError:
        raise KeyError(f"{reader!r} declares no needs of {dataset} (declared: {', '.join(module.READERS)})") from None


def versions(dataset: str) -> tuple[str, ...]:
    """The schema versions of `dataset` this Nightshift reads, oldest first."""
    return _known(dataset).READABLE


def check(where: str, schema: pa.Schema, dataset: str, reader: str, also: Iterable[str] = ()) -> str | None:
    """Hold one file's schema (its Arrow schema, with the Parquet key-value metadata)
    to what `reader` needs of `dataset`; `also`: columns this one run needs besides
    (e.g. `advantage` for an algorithm that weighs by it). Returns the version found
    (None when the file names none); raises `LayoutError` with the sentence.

    A file of an older version that is still read is not held to the columns later
    versions added (their readers fill them, null): version 1 transitions lack the
    prompt columns and are read all the same."""
    module = _known(dataset)
    meta = schema.metadata or {}
    name = meta.get(METADATA_NAME, b"").decode(errors="replace") or None
    if name is not None and name != dataset:
        raise LayoutError(f"{where} holds the {name} dataset, not {dataset}: "
                          f"{reader} reads {dataset} only from {dataset}/")
    found = meta.get(METADATA_VERSION, b"").decode(errors="replace") or None
    readable = module.READABLE
    if found is not None and found not in readable:
        raise LayoutError(f"{where} is {dataset} schema version {found} (its Parquet metadata's "
                          f"{METADATA_VERSION.decode()}), but this Nightshift reads version {_either(readable)}: "
                          f"upgrade Nightshift to read it, or write it again with this one ({WRITTEN_BY[dataset]})")
    later = set() if found is None else {c for v, cols in module.ADDED.items() if int(v) > int(found) for c in cols}
    present = set(schema.names)
    missing = [c for c in dict.fromkeys([*needs(dataset, reader), *also]) if c not in present and c not in later]
    if missing:
        version = f"{dataset} schema version {found}" if found else f"{dataset}, with no schema version"
        raise LayoutError(f"{where} ({version}) lacks the column(s) {', '.join(missing)} that {reader} needs: "
                          f"write it again with this Nightshift ({WRITTEN_BY[dataset]})")
    return found


def _either(versions: tuple[str, ...]) -> str:
    """`1`, `1 or 2`, `1, 2 or 3`."""
    return versions[0] if len(versions) == 1 else f"{', '.join(versions[:-1])} or {versions[-1]}"


def shown(fs, path: str) -> str:
    """A path as the user gave its root: with its protocol when not on the local disk."""
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return path if "file" in protocol or "local" in protocol else fs.unstrip_protocol(path)


def check_file(fs, path: str, dataset: str, reader: str, also: Iterable[str] = ()) -> str | None:
    """`check` on one file's footer, opened through an fsspec file system."""
    import pyarrow.parquet as pq

    try:
        with fs.open(path, "rb") as fh:
            schema = pq.read_schema(fh)
    except (pa.ArrowException, OSError) as e:
        raise LayoutError(f"{shown(fs, path)} is not a readable Parquet file ({e}): "
                          f"{reader} cannot read the {dataset} dataset until it is removed or replaced") from None
    return check(shown(fs, path), schema, dataset, reader, also)


def check_files(fs, paths: Iterable[str], dataset: str, reader: str, also: Iterable[str] = ()) -> list[str]:
    """`check_file` on each file (one footer each: what a scan reads anyway); the paths."""
    paths = list(paths)
    for p in paths:
        check_file(fs, p, dataset, reader, also)
    return paths


def check_dataset(root: str, dataset: str, reader: str, storage_options: dict | None = None,
                  also: Iterable[str] = ()) -> list[str]:
    """Every file of a dataset under a data root (a path or an fsspec URL) checked
    for `reader`; the files found (none: the dataset is empty or absent, which each
    reader says in its own words)."""
    import fsspec

    fs, base = fsspec.core.url_to_fs(root, **(storage_options or {}))
    return check_files(fs, sorted(fs.glob(files(base, dataset))), dataset, reader, also)
