"""`attrs.first_of`, all its columns in one pass, against the rule it implements
read straight off the rows in Python (transform/attrs.py)."""

import random

import polars as pl

from nightshift.transform import attrs as A

COLUMNS = {"p": ("a", "b"), "q": ("c",), "r": ("b", "d", "a"), "s": ("never",)}  # "a" and "b" feed two columns


def _rule(rows, n):
    """Per row and column: the value of the first of its keys the row has (a null value counts as there)."""
    have = {(r, k): v for r, k, v in rows}
    out = []
    for r in range(n):
        got = {}
        for name, keys in COLUMNS.items():
            got[name] = next((have[(r, k)] for k in keys if (r, k) in have), None)
        out.append(got)
    return out


def test_first_of_is_the_first_present_key_per_row_and_column():
    rng = random.Random(7)
    for _ in range(60):
        n = rng.randint(0, 9)
        rows = {(r, k): (r, k, rng.choice([None, f"v{rng.randint(0, 9)}"]))
                for r in range(n) for k in rng.sample(["a", "b", "c", "d", "x"], rng.randint(0, 4))}
        rows = list(rows.values())
        rng.shuffle(rows)  # the long form is in any order
        long = pl.DataFrame(rows, schema={"row": pl.UInt32, "key": pl.String, "text": pl.String}, orient="row")
        got = A.first_of(long, n, COLUMNS)
        assert got.columns == ["row", *COLUMNS] and got["row"].to_list() == list(range(n))
        assert got.schema["s"] == pl.String and got["s"].null_count() == n
        assert got.drop("row").to_dicts() == _rule(rows, n)
