"""MkDocs hook: the README as the site's home page, and benchmarks/RESULTS.md beside
the pages that cite it.

The docs are read in two places: in the repository, where the README links to
`docs/collector.md` and a page to `../benchmarks/RESULTS.md` as written, and in the
built site, which holds only what is under docs/. The files named in PULLED are added
to the site, and every relative link is rewritten to where its target lands there, so
one link works in both. A link to anything else outside docs/ is left as written, and
`mkdocs build --strict` (tests/test_readme.py) fails on it, as on a missing page or
heading.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

#: repository path -> page in the site
PULLED = {"README.md": "index.md", "benchmarks/RESULTS.md": "results.md"}
#: a Markdown link or image target: the path, then an optional #anchor
LINK = re.compile(r"\]\(([^)\s#]+)(#[^)\s]*)?\)")


def _root(config) -> Path:
    return Path(config.config_file_path).parent


def on_files(files, config):
    for src, uri in PULLED.items():
        files.append(File.generated(config, uri, abs_src_path=str(_root(config) / src)))
    return files


def _site_uri(repo_path: str, docs_dir: str) -> str | None:
    if repo_path in PULLED:
        return PULLED[repo_path]
    if repo_path.startswith(docs_dir + "/"):
        return repo_path[len(docs_dir) + 1:]
    return None


def on_page_markdown(markdown, page, config, files):
    root = _root(config)
    docs_dir = Path(config.docs_dir).resolve().relative_to(root.resolve()).as_posix()
    here = Path(page.file.abs_src_path).resolve().relative_to(root.resolve()).as_posix()
    page_dir = posixpath.dirname(page.file.src_uri)

    def fix(m: re.Match) -> str:
        target, anchor = m.group(1), m.group(2) or ""
        if "://" in target or target.startswith("mailto:"):
            return m.group(0)
        uri = _site_uri(posixpath.normpath(posixpath.join(posixpath.dirname(here), target)), docs_dir)
        if uri is None:
            return m.group(0)
        return f"]({posixpath.relpath(uri, page_dir or '.')}{anchor})"

    return LINK.sub(fix, markdown)
