"""The layout stays what docs/ARCHITECTURE.md says: each top-level folder is one
stage, a stage imports only from the stages before it, no module reaches for
another's private names, and no modules import each other in a loop. Read with
`ast` (nothing imported), every import counted, those inside functions included."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Stage -> the stages it may import from (itself always). Data flows down this list:
#: receiver -> log -> datasets -> transitions -> trainer -> checkpoint -> endpoint.
STAGES: dict[str, set[str]] = {
    "schemas": set(),
    "settings": set(),
    "storage": set(),
    "collector": {"schemas", "settings", "storage"},
    "transform": {"schemas", "settings", "storage"},
    "trainer": {"schemas", "settings", "storage"},
    "route": {"schemas", "settings", "storage"},
    "prompts": {"schemas", "settings", "storage"},
    "publish": {"schemas", "settings", "storage", "trainer", "route"},
    # judging acts through publish (a rollback, a canary stopped or promoted), so it
    # comes after it: publish/ puts versions in front of agents and never asks why
    "judge": {"schemas", "settings", "storage", "trainer", "route", "prompts", "publish"},
    "serve": {"schemas", "settings", "storage", "trainer"},
    "nightly": {"schemas", "settings", "storage", "transform", "trainer", "route", "prompts", "publish", "judge"},
    "cli": {"schemas", "settings", "storage", "collector", "transform", "trainer", "publish", "judge", "serve", "route",
            "prompts", "nightly"},
}


def _packages() -> dict[str, Path]:
    """Every package: the stage folders and the folders with an __init__.py inside them
    (a stage may group modules, e.g. trainer/algorithms/)."""
    out = {}
    for stage in STAGES:
        out[f"nightshift.{stage}"] = ROOT / stage
        for init in sorted((ROOT / stage).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT / stage)
            if rel.parts:
                out[".".join(["nightshift", stage, *rel.parts])] = init.parent
    return out


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.glob("*.py")):
            out[package + ("" if path.stem == "__init__" else f".{path.stem}")] = path
    return out


def _imports(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("nightshift.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("nightshift."):
                continue
            names = [a.name for a in node.names]
            # `from . import registry` imports a module, not a name
            subs = [n for n in names if f"{mod}.{n}" in MODULES]
            out += [(f"{mod}.{n}", [], node.lineno) for n in subs]
            rest = [n for n in names if n not in subs]
            if rest:
                out.append((mod, rest, node.lineno))
    return out


PACKAGES = _packages()
MODULES = _modules()
GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _stage(module: str) -> str:
    return module.split(".")[1]


def test_every_stage_folder_is_a_package_the_install_knows():
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(cfg["package-dir"]) == {f"nightshift.{s}" for s in STAGES}
    # every stage, and every package inside one (installed from its stage's folder)
    assert set(cfg["packages"]) == set(PACKAGES)
    assert any(p.count(".") > 1 for p in PACKAGES), "no subpackage found: the walk below the stages is broken"
    stray = [str(d.relative_to(ROOT)) for s in STAGES for d in (ROOT / s).rglob("*")
             if d.is_dir() and d.name != "__pycache__" and list(d.glob("*.py")) and not (d / "__init__.py").exists()]
    assert not stray, "folders of modules that are not packages (the install would leave them out): " + ", ".join(stray)


def test_stages_import_only_from_earlier_stages():
    bad = [f"{MODULES[src].relative_to(ROOT)}:{line} imports {mod}"
           for src, imports in GRAPH.items() for mod, _, line in imports
           if _stage(mod) != _stage(src) and _stage(mod) not in STAGES[_stage(src)]]
    assert not bad, "imports against the flow of data:\n" + "\n".join(bad)


def test_no_module_takes_another_modules_private_names():
    bad = [f"{MODULES[src].relative_to(ROOT)}:{line} takes {n} from {mod}"
           for src, imports in GRAPH.items() for mod, names, line in imports
           for n in names if n.startswith("_") and not n.startswith("__") and mod != src]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    edges = {src: sorted({m for m, _, _ in imports if m in MODULES and m != src}) for src, imports in GRAPH.items()}
    # a package's __init__ importing its own modules is how a package hands names on
    edges = {s: [m for m in ms if not (s in PACKAGES and m.startswith(s + "."))] for s, ms in edges.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in edges[n]:
            if state.get(m) == 1:
                cycles.append(" -> ".join(stack[stack.index(m):] + [m]))
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(edges):
        if n not in state:
            visit(n)
    assert not cycles, "modules that import each other:\n" + "\n".join(cycles)


def test_architecture_doc_names_every_stage_and_module():
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    missing = [f"{s}/" for s in STAGES if f"{s}/" not in doc]
    missing += [str(p.relative_to(ROOT)) for n, p in MODULES.items() if p.stem != "__init__" and p.name not in doc]
    assert not missing, "docs/ARCHITECTURE.md does not mention: " + ", ".join(missing)
    for folder in re.findall(r"`([a-z_]+)/`", doc):
        assert (ROOT / folder).is_dir(), f"docs/ARCHITECTURE.md names {folder}/, which does not exist"
