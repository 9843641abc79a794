"""The meta-prompts: the text the proposer LLM is sent, as files a user can read and
change (Agent Lightning's were fixed until users asked: its issue #439).

Built-in files live in `prompts/meta/`: `critique.md` (what is wrong with the prompt,
judged from the trajectories) and one or more `edit*.md` (rewrite it from the
critique; each candidate of a parent uses the next edit file in turn, so a round
mixes a free rewrite with a conservative one-point fix). `apo.meta_prompts: DIR`
replaces the files of the same name and adds its own `edit*.md`.

`{{field}}` is replaced once, in one pass (a value holding `{{date}}` stays as it
is). A file that names a field no one fills, or leaves out a field it needs, is
refused with its name before anything is sent.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

BUILT_IN = Path(__file__).resolve().parent / "meta"
FIELD = re.compile(r"\{\{([A-Za-z_][A-Za-z0-9_]*)\}\}")

#: kind -> (fields it may use, fields it must use)
FIELDS = {
    "critique": ({"prompt", "tools", "trajectories", "failed", "succeeded", "placeholders", "tool_names", "max_words"},
                 {"prompt", "trajectories"}),
    "edit": ({"prompt", "tools", "critique", "placeholders", "tool_names", "max_chars"}, {"prompt", "critique"}),
}


class MetaError(ValueError):
    """A meta-prompt file that cannot be used: one sentence naming it."""


@dataclass(frozen=True)
class MetaPrompt:
    name: str  # the file name
    path: str
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def fill(self, values: dict[str, object]) -> str:
        return FIELD.sub(lambda m: str(values[m.group(1)]), self.text)


@dataclass(frozen=True)
class MetaPrompts:
    critique: MetaPrompt
    edits: tuple[MetaPrompt, ...]

    def record(self) -> dict[str, dict]:
        """What the manifest keeps: each file's path and hash."""
        return {m.name: {"path": m.path, "sha256": m.sha256} for m in (self.critique, *self.edits)}


def _read(path: Path, kind: str) -> MetaPrompt:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise MetaError(f"meta-prompt {path} is not UTF-8 text") from None
    except OSError as e:
        raise MetaError(f"cannot read meta-prompt {path}: {e.strerror}") from None
    if not text.strip():
        raise MetaError(f"meta-prompt {path} is empty")
    allowed, needed = FIELDS[kind]
    used = set(FIELD.findall(text))
    unknown = sorted(used - allowed)
    if unknown:
        raise MetaError(f"meta-prompt {path} uses {', '.join('{{' + u + '}}' for u in unknown)}, which nothing fills "
                        f"(a {kind} file may use {', '.join('{{' + a + '}}' for a in sorted(allowed))})")
    missing = sorted(needed - used)
    if missing:
        raise MetaError(f"meta-prompt {path} leaves out {', '.join('{{' + m + '}}' for m in missing)}, "
                        f"which a {kind} file must send")
    return MetaPrompt(path.name, str(path), text)


def load(folder: str = "") -> MetaPrompts:
    """The built-in meta-prompts, with `folder`'s files of the same name in their place
    and its other `edit*.md` added."""
    files = {p.name: p for p in sorted(BUILT_IN.glob("*.md"))}
    if folder:
        d = Path(folder).expanduser()
        if not d.is_dir():
            raise MetaError(f"apo.meta_prompts: {folder} is not a folder")
        mine = {p.name: p for p in sorted(d.glob("*.md"))}
        if not any(n == "critique.md" or n.startswith("edit") for n in mine):
            raise MetaError(f"apo.meta_prompts: {folder} holds no critique.md or edit*.md")
        files.update(mine)
    critique = _read(files["critique.md"], "critique")
    edits = tuple(_read(p, "edit") for n, p in sorted(files.items()) if n.startswith("edit"))
    return MetaPrompts(critique, edits)
