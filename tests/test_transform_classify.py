import polars as pl
import pytest


@pytest.mark.parametrize("text,want", [
    ("[1,2,3]", [1, 2, 3]), ("[]", []), ("[-5,0]", [-5, 0]),  # the collector's own form: split and cast
    ("[ 1, 2 ]", [1, 2]), ("[[1,2],[3]]", [1, 2]),  # JSON text from elsewhere; a list per choice: the first
    ("[1,2,3000000000]", None), ("[1,2", None), ("abc", None), ("[1,,2]", None), ("[1,2]x", None),  # not ids
])
def test_token_id_lists_are_read_whatever_their_text_and_never_guessed(text, want):
    import pyarrow as pa

    from nightshift.schemas.common import ATTRIBUTES
    from nightshift.transform.calls import token_columns

    def attr(v):
        return [{"key": "prompt_token_ids", "value": {"type": "string", "string_value": v, "int_value": None,
                 "double_value": None, "bool_value": None, "bytes_value": None, "json_value": None}}]

    df = pl.from_arrow(pa.table({"attributes": pa.array([attr(text), attr("[4,5]"), []], ATTRIBUTES)}))
    got = token_columns(df)
    assert got["prompt_token_ids"].to_list() == [want, [4, 5], None]
    # a value that is there but not ids is counted, so the build can report it
    assert got["bad_token_ids"].to_list() == [want is None, False, False]
