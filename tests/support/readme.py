"""The README read as a program: its fenced blocks in order, and the commands in them.

tests/test_readme.py and tests/test_first_hour.py run what the README says, so that
the README cannot drift from the code. These helpers only cut the text into pieces;
they never add a step, so whatever a test runs is what a reader would type.

Conventions the README keeps (and these tests rely on):
- the first-hour walkthrough sits between `<!-- first-hour: ...` and
  `<!-- first-hour: end -->`;
- a shell block there starts with `# terminal N (WHO)`: WHO is `Nightshift` (its own
  environment) or `your agent` (the agent's);
- a Python block whose first line is `# NAME.py ...` is a file the reader saves as NAME.py;
- a block without a language is output shown to the reader, its first line the
  `$ command` that printed it.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FIRST_HOUR_START = "<!-- first-hour:"
FIRST_HOUR_END = "<!-- first-hour: end -->"
FENCE = re.compile(r"^(\s*)```\s*([\w+-]*)\s*$")
TERMINAL = re.compile(r"^# terminal (\d+) \(([^)]+)\)")
FILE = re.compile(r"^# ([\w.-]+\.py)\b")


@dataclass(frozen=True)
class Block:
    lang: str  # sh, bash, python, yaml, ... or "" (output)
    text: str
    line: int  # 1-based line of its opening fence, for messages
    first_hour: bool  # inside the walkthrough

    @property
    def first_line(self) -> str:
        return self.text.split("\n", 1)[0].strip()

    @property
    def terminal(self) -> tuple[str, str] | None:
        """(number, who) of a walkthrough shell block: ("3", "your agent")."""
        m = TERMINAL.match(self.first_line)
        return (m.group(1), m.group(2)) if m else None

    @property
    def filename(self) -> str | None:
        m = FILE.match(self.first_line) if self.lang == "python" else None
        return m.group(1) if m else None

    @property
    def is_shell(self) -> bool:
        return self.lang in ("sh", "bash", "shell", "console")


def blocks(path: Path = README) -> list[Block]:
    """Every fenced block of a Markdown file, in order."""
    out: list[Block] = []
    inside = False
    lang, start, buf, indent = "", 0, [], ""
    in_first_hour = False
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not inside:
            if line.startswith(FIRST_HOUR_END):
                in_first_hour = False
            elif line.startswith(FIRST_HOUR_START):
                in_first_hour = True
            m = FENCE.match(line)
            if m:
                inside, indent, lang, start, buf = True, m.group(1), m.group(2).lower(), no, []
            continue
        if line.strip() == "```":
            out.append(Block(lang, "\n".join(buf), start, in_first_hour))
            inside = False
            continue
        buf.append(line[len(indent):] if line.startswith(indent) else line)
    assert not inside, f"{path}: the block opened at line {start} is never closed"
    return out


def commands(block: Block) -> list[str]:
    """The commands of a shell block: continuation lines joined, blank and comment-only
    lines dropped, each command's own trailing comment kept (bash ignores it)."""
    return [c for c, _ in commands_with_output(block)]


def commands_with_output(block: Block) -> list[tuple[str, list[str]]]:
    """Each command of a shell block with the output the README shows for it: the
    `# ...` lines right under it (a comment line anywhere else is a heading)."""
    out: list[tuple[str, list[str]]] = []
    cur = ""
    under = False  # the previous line ended a command or was its output
    for line in block.text.splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            if under and line.startswith("# "):
                out[-1][1].append(line[2:])
            else:
                under = False
            continue
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        if not _closed(cur + line):  # a quoted string that goes on over the next line
            cur += line + "\n"
            continue
        out.append(((cur + line).strip(), []))
        cur, under = "", True
    if cur:
        out.append((cur.strip(), []))
    return out


def _closed(command: str) -> bool:
    try:
        shlex.split(command, comments=True)
    except ValueError:
        return False
    return True


def nightshift_argv(command: str) -> list[str] | None:
    """The arguments after `nightshift` (or after `-m nightshift.cli` under a launcher such
    as torchrun or accelerate), comments and trailing shell operators cut off; None when
    the command runs no nightshift subcommand."""
    words = shlex.split(command, comments=True)
    for i, w in enumerate(words):
        if w == "nightshift" and i == 0:
            rest = words[1:]
            break
        if w == "-m" and i + 1 < len(words) and words[i + 1] == "nightshift.cli":
            rest = words[i + 2:]
            break
    else:
        return None
    for j, w in enumerate(rest):
        if w in ("&&", "||", "|", ";", "&"):
            return rest[:j]
    return rest
