"""Every command in the README is run by a test, and the docs site builds (issue 26).

Who runs what:
- the first-hour walkthrough (between the README's `first-hour` markers): every step,
  for real, by tests/test_first_hour.py;
- the other shell blocks: the `curl` examples here, against a real collector, their
  answers compared with the `# ...` lines the README prints under them; `make demo` and
  `make test` are not run here (minutes each, and the second is this suite): their
  targets must exist, and CI's script must run `make test`;
- every `nightshift ...` command in a shell block or an inline code span, of the README
  and of every page under docs/: parsed by the real `nightshift` argument parser, so a
  renamed flag, a removed subcommand or a bad choice fails here;
- `mkdocs build --strict`: the README (the site's home page), every docs page and
  benchmarks/RESULTS.md, so a link to a page or a heading that is gone fails.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from support.readme import README, ROOT, blocks, commands, commands_with_output, nightshift_argv

DOCS = sorted((ROOT / "docs").glob("*.md"))
NOT_RUN = {
    "make demo": "minutes of CPU; its path runs in tests/test_closed_loop.py and tests/test_nightly.py",
    "make test": "this suite: CI's .ci/run runs it",
    # the scale-out recipes: each needs what is not here (the otelcol binary, S3, a Ray cluster, GPUs);
    # the test named beside each runs its path on this machine
    "otelcol --config recipes/otelcol-loadbalancing.yaml":
        "the otelcol-contrib binary; tests/test_recipes.py checks the file, tests/test_collectors_side_by_side.py "
        "splits traces by trace id across collectors as it does",
    "nightshift collect --data s3://bucket/lake --wal /var/lib/nightshift/wal-$POD":
        "a bucket; tests/test_collectors_side_by_side.py runs two collectors on S3 through moto",
    "nightshift build --data s3://bucket/lake --build-engine ray --build-ray-address auto":
        "a running cluster; tests/test_transform_ray_local.py joins one by address, tests/test_transform_ray.py "
        "builds on a local one",
    "torchrun --nproc_per_node 8 -m nightshift.cli train --config nightshift.yaml":
        "8 GPUs; tests/test_trainer_ddp.py runs it with 2 processes on gloo",
}
INLINE = re.compile(r"`(nightshift [^`]+)`")


def _outside_first_hour() -> list[tuple[str, list[str]]]:
    """(command, the output the README shows under it) of the shell blocks outside the walkthrough."""
    return [cs for b in blocks(README) if b.is_shell and not b.first_hour for cs in commands_with_output(b)]


def test_the_readme_starts_with_the_two_commands_and_ci_runs_the_second():
    first = blocks(README)[0]
    assert first.is_shell and [shlex.split(c, comments=True) for c in commands(first)] == [["make", "demo"], ["make", "test"]], \
        f"README.md's first block must be `make demo` and `make test`, got:\n{first.text}"
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert "make test" in ci, ci


def test_every_readme_command_is_run_by_a_test():
    """A command added to the README outside the walkthrough must be run here (or listed
    in NOT_RUN with the reason): the list below is what this module runs."""
    unrun = []
    for c, _ in _outside_first_hour():
        if " ".join(shlex.split(c, comments=True)) in NOT_RUN or c.startswith("curl "):
            continue
        unrun.append(c)
    assert not unrun, f"README commands no test runs (run them in tests/test_readme.py or the walkthrough): {unrun}"
    walkthrough = [c for b in blocks(README) if b.is_shell and b.first_hour for c in commands(b)]
    assert any(c.startswith("nightshift build") for c in walkthrough), "the walkthrough builds nothing"


def test_the_readme_curl_examples_answer_what_it_shows(collector):
    curls = [(c, shown) for c, shown in _outside_first_hour() if c.startswith("curl ")]
    assert curls, "the README has no feedback example"
    for c, shown in curls:
        c = c.replace("127.0.0.1:4318", f"127.0.0.1:{collector.http_port}")
        p = subprocess.run(["bash", "-c", c], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, (c, p.stdout, p.stderr)
        assert shown, f"the README shows no answer under {c}"
        assert p.stdout.strip().splitlines() == shown, (c, p.stdout, shown)


def _nightshift_commands() -> list[tuple[str, str, list[str], bool]]:
    """(where, command, argv, whole) of every nightshift command in shell blocks (whole
    commands) and inline code spans (often a command's name and a flag or two, so
    required arguments may be left out)."""
    out = []
    for path in [README, *DOCS]:
        rel = path.relative_to(ROOT)
        for b in blocks(path):
            if b.is_shell:
                for c in commands(b):
                    argv = nightshift_argv(c)
                    if argv is not None:
                        out.append((f"{rel}:{b.line}", c, argv, True))
        text = path.read_text(encoding="utf-8")
        for m in INLINE.finditer(text):
            c = m.group(1)
            if "..." in c or "…" in c or "<" in c:
                continue  # an elision for the reader, not a command
            line = text.count("\n", 0, m.start()) + 1
            out.append((f"{rel}:{line}", c, nightshift_argv(c) or [], False))
    return out


def _flags(argv: list[str]) -> list[str]:
    """The --flags of a command line, up to `--` (after it, flags for another program)."""
    words = argv[:argv.index("--")] if "--" in argv else argv
    return [w.split("=", 1)[0] for w in words if w.startswith("--")]


def _options_of(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The option strings of the (sub)command argv names."""
    for word in argv:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if subs and word in subs[0].choices:
            parser = subs[0].choices[word]
    return {s for a in parser._actions for s in a.option_strings}


def test_every_nightshift_command_in_the_readme_and_docs_parses():
    from nightshift.cli.main import build_parser

    cmds = _nightshift_commands()
    assert len(cmds) > 50, f"found only {len(cmds)} commands: is the extraction broken?"
    parser = build_parser()
    bad = []
    for where, c, argv, whole in cmds:
        if not argv or argv[-1] in ("--help", "-h"):
            continue
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                parser.parse_args(argv)
        except SystemExit as e:
            said = err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else str(e)
            if e.code and (whole or "the following arguments are required" not in said):
                bad.append(f"{where}: `{c}`: {said}")
                continue
        # argparse takes any unambiguous prefix of a flag: a flag renamed to a longer name
        # would still parse, so each must be spelled as the command declares it
        inexact = [f for f in _flags(argv) if f not in _options_of(parser, argv)]
        if inexact:
            bad.append(f"{where}: `{c}`: not the command's own spelling: {', '.join(inexact)}")
    assert not bad, "commands the nightshift parser refuses:\n" + "\n".join(bad)


def test_the_docs_site_builds_strict(tmp_path):
    """MkDocs (the `test` extra) builds README.md, docs/ and benchmarks/RESULTS.md with
    --strict: a broken link, a missing heading or a page left out of the nav fails."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, f"mkdocs build --strict failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    site = tmp_path / "site"
    assert (site / "index.html").exists() and (site / "results" / "index.html").exists()
    assert not list(site.rglob("hooks.py")), "the MkDocs hook was published as a page asset"
    home = (site / "index.html").read_text(encoding="utf-8")
    assert 'href="collector/' in home, "the README's links to docs/ were not rewritten for the site"
