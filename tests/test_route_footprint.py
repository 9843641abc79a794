"""The proxy's memory: what `nightshift route` imports to serve (issue 27's route
target). Peak RSS went 48 -> 87 MiB when the route began to import
schemas.prompt_identity, whose package loaded every dataset schema and with them
pyarrow and numpy (36 MiB), none of which the request path uses."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("pyarrow", "polars", "numpy", "pandas", "torch", "transformers")


def test_serving_imports_no_dataframe_or_tensor_library():
    code = ("import json, sys\n"
            "import nightshift.cli.route_cmd, nightshift.route.server, nightshift.route.prompt\n"
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_schemas_package_still_gives_its_names():
    """The lazy package (PEP 562) answers every name it exported before."""
    from nightshift import schemas
    from nightshift.schemas import DATASETS, SCHEMA_VERSION, attr, spans

    assert list(DATASETS) == ["spans", "logs", "feedback", "transitions"]
    assert DATASETS["spans"] is spans and schemas.DATASETS is DATASETS
    from nightshift.schemas import common

    assert SCHEMA_VERSION == common.SCHEMA_VERSION and attr is common.attr
    assert all(getattr(schemas, n) is not None for n in schemas.__all__)


def test_the_route_command_as_users_start_it_imports_none_either():
    """`nightshift route` builds every subcommand's parser: `nightshift export`'s
    read its format names from transform/export.py and loaded pyarrow, fsspec
    and numpy into the proxy (41 -> 87 MiB idle)."""
    code = ("import json, runpy, sys\n"
            "sys.argv = ['nightshift', 'route', '--help']\n"
            "try:\n    runpy.run_module('nightshift.cli', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
