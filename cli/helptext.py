"""The end of every command's `--help`: where its settings come from and what its
exit codes mean, said the same way on every command, so a person (or a script
wrapping a command) finds them in one place without reading the source."""

from __future__ import annotations

import textwrap

WIDTH = 88


def tail(yaml: str, env: str, exits: str) -> str:
    """`yaml`: the sections of --config the command reads (e.g. "`train:` and
    top-level `data:`"); `env`: its variables' prefix (e.g. "NIGHTSHIFT_TRAIN_*,
    NIGHTSHIFT_DATA"); `exits`: each exit code and its meaning."""
    parts = [f"YAML (--config FILE): {yaml}; top-level `log_format: text|json`.",
             f"Environment: {env}; NIGHTSHIFT_LOG_FORMAT. Flags win over both.",
             f"Exit codes: {exits}."]
    return "\n".join(textwrap.fill(p, WIDTH, subsequent_indent="  ") for p in parts)


def epilog(body: str, yaml: str, env: str, exits: str) -> str:
    """`body` (examples, notes; may be empty), then the tail."""
    return (body.rstrip() + "\n\n" if body.strip() else "") + tail(yaml, env, exits)
