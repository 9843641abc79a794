"""Token ids read once per trace: a call's ids sliced out of its trace's longest
prompt are the ids its own text says, whatever the text (transform/calls.py)."""

import random

import polars as pl
import pyarrow as pa
import pytest

from nightshift.schemas.common import ATTRIBUTES
from nightshift.transform import calls as C


def _attr(key, text):
    return {"key": key, "value": {"type": "array", "string_value": None, "int_value": None, "double_value": None,
                                  "bool_value": None, "bytes_value": None, "json_value": text}}


def _calls(rows):
    """Call rows of (trace, prompt text, completion text), None for an id list not there."""
    attrs = [[_attr(k, v) for k, v in (("prompt_token_ids", p), ("response_token_ids", c)) if v is not None]
             for _, p, c in rows]
    return pl.from_arrow(pa.table({"trace_id": [t for t, _, _ in rows], "attributes": pa.array(attrs, ATTRIBUTES)}))


def _alone(text):
    """What one row's text reads as by itself (the trace-less path, one row at a time)."""
    got = C.token_columns(_calls([("x", text, None)]).drop("trace_id"))
    return got["prompt_token_ids"][0] if text is not None else None


def _ids(text):
    return None if text is None else (_alone(text).to_list() if _alone(text) is not None else None)


def _fmt(ids):
    return "[" + ",".join(map(str, ids)) + "]"


def _counting(monkeypatch, by: str | None = None) -> list[int]:
    """The ids each parse reads (the split's, and the anchors' read from their bytes),
    or only those of the parse `by` names."""
    parsed: list[int] = []
    split, digits = C._split_ids, C._digit_ids

    def count(s: pl.Series) -> pl.Series:
        parsed.append(int(s.list.len().sum() or 0))
        return s

    def from_bytes(*args):
        got = digits(*args)
        return got if got is None or by == "split" else count(got)

    if by != "bytes":
        monkeypatch.setattr(C, "_split_ids", lambda text: split(text).map_batches(count, return_dtype=pl.List(pl.Int32)))
    monkeypatch.setattr(C, "_digit_ids", from_bytes)
    return parsed


def test_a_trajectorys_ids_are_parsed_once_from_its_longest_prompt(monkeypatch):
    # the benchmark's shape: each prompt is the last prompt, its answer and a new turn
    p1, c1 = list(range(100, 130)), [7, 8, 9]
    p2 = p1 + c1 + [40, 41]
    c2 = [5, 6]
    p3 = p2 + c2 + [1, 2, 3]
    c3 = [11, 12, 13, 14]
    rows = [("t1", _fmt(p1), _fmt(c1)), ("t1", _fmt(p2), _fmt(c2)), ("t1", _fmt(p3), _fmt(c3))]
    parsed = _counting(monkeypatch)  # ids each parse read
    got = C.token_columns(_calls(rows))
    assert got["prompt_token_ids"].to_list() == [p1, p2, p3]
    assert got["completion_token_ids"].to_list() == [c1, c2, c3]
    assert got["bad_token_ids"].to_list() == [False] * 3
    # the longest prompt once; the last completion (after no prompt) and nothing else alone
    assert sum(parsed) == len(p3) + len(c3) < sum(len(x) for x in (p1, c1, p2, c2, p3, c3))


CASES = [
    # (trace, prompt, completion)
    ("a", "[1,2,3]", "[4,5]"), ("a", "[1,2,3,4,5,6]", "[7]"), ("a", "[1,2,3,4,5,6,7,8]", "[9,10]"),
    ("b", "[10,-2,0]", "[2147483647]"), ("b", "[10,-2,0,2147483647,-2147483648]", None),  # widths of every sign
    ("c", "[+1,2]", "[3]"), ("c", "[+1,2,3,4]", "[5]"),  # a plus: the bytes still say where each id ends
    ("d", "[007,1]", "[2]"), ("d", "[007,1,2,3]", "[4]"),  # leading zeros: the same
    ("k", "[]1]", None), ("k", "[]1,2]", None),  # a bracket inside: more ends than ids, each read alone
    ("n", "[1,2]", "[]"), ("n", "[1,2,3]", "[4,5,6]"), ("n", "[1,2,3,4,5]", "[6]"),  # a completion two ids long, not three
    ("e", "[]", "[]"), ("e", "[5,6]", "[]"), ("e", "[5,6,7]", "[8]"),  # empty lists
    ("f", None, "[1,2]"), ("f", "[3]", None), ("f", None, None),  # missing sides
    ("g", "[1,2]", "[3]"), ("g", "[1,2,4,5]", "[6]"),  # a completion the next prompt does not go on with
    ("h", "[1,2]", "[3]"), ("a", "[1,2,3,99]", "[1]"), ("h", "[1,2,3,4]", "[5]"),  # traces interleaved
    ("i", "[12]", "[3]"), ("i", "[123,4]", "[5]"),  # "[12" is a byte prefix of "[123,": not an id prefix
    ("j", "[]", None), ("j", "[]", "[1]"),  # a trace with no ids to share
]


@pytest.mark.parametrize("order", [1, -1])
def test_ids_sliced_from_the_longest_prompt_are_each_rows_own(order):
    rows = CASES[::order]
    got = C.token_columns(_calls(rows))
    want_p = [_ids(p) for _, p, _ in rows]
    want_c = [_ids(c) for _, _, c in rows]
    assert got["prompt_token_ids"].to_list() == want_p
    assert got["completion_token_ids"].to_list() == want_c
    assert got["prompt_token_ids"].dtype == pl.List(pl.Int32) and not got["bad_token_ids"].any()
    assert [1, 2, 3, 4, 5, 6, 7, 8] in want_p and [5, 6, 7] in want_p and [4, 5] in want_c  # read, not all null


def test_an_anchor_not_written_canonically_is_still_parsed_once(monkeypatch):
    # its ends were counted from each id's digits, so "+1" or "007" (which the split
    # reads) made the anchor cover nothing and every row was parsed again on its own
    rows = [("c", "[+1,2]", "[3]"), ("c", "[+1,2,3,4]", "[5]"), ("d", "[007,1]", "[2]"), ("d", "[007,1,2,3]", "[4]")]
    parsed = _counting(monkeypatch)
    got = C.token_columns(_calls(rows))
    assert got["prompt_token_ids"].to_list() == [[1, 2], [1, 2, 3, 4], [7, 1], [7, 1, 2, 3]]
    assert got["completion_token_ids"].to_list() == [[3], [5], [2], [4]]
    assert sum(parsed) == 4 + 1 + 4 + 1  # each anchor once, and the completions after no prompt


def test_ids_the_split_cannot_read_are_read_as_json_and_odd_ones_counted_not_raised():
    # "[1, 2]" needs the JSON parse; "[007,1]" and an id past int64 are not JSON ids:
    # the guarded parse raised on the first (a traceback) and read a null id in the second
    rows = [("a", "[1, 2]", "[3]"), ("a", "[1, 2, 3, 4]", "[5]"), ("b", "[007,1]", "[2]"),
            ("c", "[99999999999999999999]", "[1]")]
    got = C.token_columns(_calls(rows))
    assert got["prompt_token_ids"].to_list() == [[1, 2], [1, 2, 3, 4], None, None]
    assert got["completion_token_ids"].to_list() == [[3], [5], [2], [1]]
    assert got["bad_token_ids"].to_list() == [False, False, True, True]


def test_a_value_that_is_not_ids_leaves_the_shared_parse_for_the_guarded_one():
    rows = [("a", "[1,2,3]", "[4]"), ("a", "[1,2,3,4,5]", "[6]"), ("b", "[1,2,3000000000]", "[1]")]
    got = C.token_columns(_calls(rows))
    assert got["prompt_token_ids"].to_list() == [[1, 2, 3], [1, 2, 3, 4, 5], None]
    assert got["completion_token_ids"].to_list() == [[4], [6], [1]]
    assert got["bad_token_ids"].to_list() == [False, False, True]


def test_anchors_of_plain_digits_are_read_from_their_bytes_not_split(monkeypatch):
    # the collector's form of an int array: the anchors' ids come from their bytes, the
    # split reads only what no anchor covers (here the last completion, after no prompt)
    p1, c1 = list(range(99_999_990, 100_000_000)) + [0, 5, 10**7], [1, 22, 333]
    p2 = p1 + c1 + [4444, 55555, 666666, 7777777]
    rows = [("t", _fmt(p1), _fmt(c1)), ("t", _fmt(p2), _fmt([8]))]
    split = _counting(monkeypatch, "split")
    from_bytes = _counting(monkeypatch, "bytes")
    got = C.token_columns(_calls(rows))
    assert got["prompt_token_ids"].to_list() == [p1, p2]
    assert got["completion_token_ids"].to_list() == [c1, [8]]
    assert from_bytes == [len(p2)] and sum(split) == 1


ANCHORS = [
    ["[1,2,3]", "[0]", "[12345678,87654321]", "[99999999,1]"],  # every width the byte parse reads
    ["[00000007,007,0]", "[10000000]"],  # leading zeros: the number, as the split reads it
    ["[1,2]", "[123456789]"],  # nine digits: the split's (it fits int32)
    ["[1,2]", "[2147483647,-2147483648]"],  # signs
    ["[1,2]", "[2147483648]"],  # past int32: the split raises
    ["[+1,2]"], ["[1, 2]"], ["[1,,2]"], ["[1,2,]"], ["[,1]"],  # what the split reads or rejects alone
    ["[1]2]", "[3]"], ["[]1]"], ["[1,[2]"], ["[1,2"],  # brackets inside, a torn list
    ["[\u0661]"], ["[1,\u0662]"],  # digits that are not ASCII
]


def _both(texts: list[str]) -> tuple[list | None, list | None]:
    """The ids the byte parse reads and those Polars' split reads (None: refused)."""
    text = pl.Series("p", texts, pl.String)
    try:
        want = text.to_frame().select(C._split_ids(pl.col("p")))["p"].to_list()
    except (pl.exceptions.ComputeError, pl.exceptions.InvalidOperationError):
        want = None
    try:
        got = C._anchors(text)[0].to_list()
    except (pl.exceptions.ComputeError, pl.exceptions.InvalidOperationError):
        got = None
    return got, want


@pytest.mark.parametrize("texts", ANCHORS)
def test_the_byte_parse_reads_what_the_split_reads(texts):
    got, want = _both(texts)
    assert got == want


def test_the_byte_parse_reads_what_the_split_reads_on_random_lists():
    rng = random.Random(7)
    for _ in range(200):
        texts = [_fmt([rng.choice([rng.randrange(10), rng.randrange(10**rng.randrange(1, 9))]) for _ in range(rng.randrange(1, 30))])
                 for _ in range(rng.randrange(1, 6))]
        if rng.random() < 0.3:  # a byte changed: the same ids, or the same refusal
            i = rng.randrange(len(texts))
            j = rng.randrange(len(texts[i]))
            texts[i] = texts[i][:j] + rng.choice("0123456789,[]+- x") + texts[i][j + 1:]
        got, want = _both(texts)
        assert got == want, texts


@pytest.mark.parametrize("odd", [None, "123456789", "1 ", "[2", "+3"])
def test_the_byte_parse_reads_what_the_split_reads_across_its_blocks(odd):
    # anchors longer than a block of bytes and of ids (the parse works a block at a
    # time): the ids after a block's edge, and an odd one far into the text
    rng = random.Random(3)
    ids = [[rng.randrange(10**rng.randrange(1, 9)) for _ in range(rng.randrange(20_000, 40_000))] for _ in range(4)]
    texts = [_fmt(x) for x in ids]
    if odd is not None:
        texts[2] = texts[2][:-1] + "," + odd + "]"
    assert sum(len(t.encode()) for t in texts) > 2 * C._BYTES and sum(map(len, ids)) > 2 * C._IDS
    got, want = _both(texts)
    assert got == want and (odd is not None or got == ids)
