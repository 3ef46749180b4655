"""The layers of docs/architecture.md, enforced over the source (no import is executed).

Each package is a layer; a module imports only from its own package and from layers below it,
never from a sibling on its own layer or from above. Within a package the imports form no cycle.
Lazy imports inside functions count as much as those at the top of a module: what a module
needs, it needs. Only speculative/llamacpp/ imports llama_cpp, and no class or function grows
past the size a reader takes in at once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# component -> rank: a module may import a component of lower rank, or its own
LAYERS = {
    "cli": 6,
    "serving": 5,
    "engine": 4,
    "drafters": 3, "llamacpp": 3, "chat": 3,
    "models": 2, "grammar": 2,
    "decoding": 1,
    "errors": 0, "files": 0,
}
BASE = {"errors", "files"}  # the two base modules import each other freely (one layer)
MAX_CLASS, MAX_FUNCTION = 250, 60


def sources() -> dict[str, Path]:
    """Module name -> file, for speculative/ and cli/ (which is installed as speculative.cli)."""
    found = {}
    for folder, package in ((ROOT / "speculative", "speculative"), (ROOT / "cli", "speculative.cli")):
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if folder.name == "speculative" and parts[:1] == ("cli",):
                continue  # the source checkout's bridge to cli/
            found[".".join((package, *parts))] = path
    return found


MODULES = sources()


def component(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "speculative" and len(parts) > 1 else None


def imports(module: str, path: Path) -> list[tuple[str, int]]:
    """The speculative modules (or packages) `module` imports, with their lines."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + is_package]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:  # `from package import module` names the module
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in MODULES else target, node.lineno))
    return [(name, line) for name, line in found if name.split(".")[0] == "speculative"]


def test_every_module_belongs_to_a_layer():
    assert {component(m) for m in MODULES} - {None} == set(LAYERS)


def wrong_imports(modules: dict[str, Path]) -> list[str]:
    """Each import of a sibling on the same layer or of a higher layer, with where it is."""
    wrong = []
    for module, path in modules.items():
        mine = component(module)
        for target, line in imports(module, path):
            theirs = component(target)
            if mine is None or theirs is None or theirs == mine or {mine, theirs} <= BASE:
                continue
            if LAYERS[theirs] >= LAYERS[mine]:
                wrong.append(f"{path.name}:{line} ({mine}) imports {target} ({theirs})")
    return wrong


def test_no_module_imports_a_sibling_or_a_higher_layer():
    wrong = wrong_imports(MODULES)
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    graph = {m: {t for t, _ in imports(m, p) if t in MODULES and t != m} for m, p in MODULES.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_only_the_binding_imports_llama_cpp():
    wrong = []
    for module, path in MODULES.items():
        if component(module) == "llamacpp":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            wrong += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names if n.split(".")[0] == "llama_cpp"]
    assert not wrong


def test_no_class_or_function_is_too_long():
    long = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            limit = (MAX_CLASS if isinstance(node, ast.ClassDef)
                     else MAX_FUNCTION if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None)
            if limit and node.end_lineno - node.lineno + 1 > limit:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: "
                            f"{node.end_lineno - node.lineno + 1} lines (at most {limit})")
    assert not long, "\n".join(long)


def test_the_checks_see_a_wrong_import(tmp_path):
    """The layer check reads relative and lazy imports as the interpreter would."""
    path = tmp_path / "loop.py"
    path.write_text("def f():\n    from ..engine import engine\n    from . import cache\n")
    found = {name for name, _ in imports("speculative.decoding.loop", path)}
    assert found == {"speculative.engine.engine", "speculative.decoding.cache"}
    assert wrong_imports({"speculative.decoding.loop": path}) == [
        "loop.py:2 (decoding) imports speculative.engine.engine (engine)"]
    sibling = tmp_path / "auto.py"
    sibling.write_text("from speculative.llamacpp.model import LlamaModel\n")
    assert wrong_imports({"speculative.drafters.auto": sibling}) == [
        "auto.py:1 (drafters) imports speculative.llamacpp.model (llamacpp)"]


def test_each_package_index_names_all_its_modules():
    """A package's docstring is its index: each of its modules (and sub-packages) on a line of
    its own, `  name.py  what it does`, so a newcomer finds where each job is done."""
    root = ROOT / "speculative"
    for package in sorted(p for p in root.iterdir() if (p / "__init__.py").is_file()):
        index = ast.get_docstring(ast.parse((package / "__init__.py").read_text()), clean=False) or ""
        named = set(re.findall(r"^ {2,}(\w+)(?:\.py|/)\s", index, re.MULTILINE))
        modules = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
        modules |= {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}
        assert modules <= named, f"{package.name}/__init__.py does not name {sorted(modules - named)}"


def _sections(text: str) -> dict[str, str]:
    """docs/architecture.md's `### ` sections by heading, each with its text."""
    parts = re.split(r"^### (.+)$", text, flags=re.MULTILINE)
    return {heading.strip(): body for heading, body in zip(parts[1::2], parts[2::2])}


def _where(section: str) -> list[str]:
    """The paths a section's tables name in their first column ("where")."""
    return [path for line in section.splitlines() if line.startswith("| `")
            for path in re.findall(r"`([^`]+)`", line.split("|")[1])]


def test_architecture_names_every_module_and_script():
    """docs/architecture.md names each module in its package's section (whole, or by its file
    name), each script of scripts/ and each module of its benchmarks (scripts/bench/), and no file
    that does not exist."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    sections = _sections(text)
    packages = {"cli": ROOT / "cli", **{f"speculative/{p.name}": p for p in (ROOT / "speculative").iterdir()
                                         if (p / "__init__.py").is_file()}}
    missing = []
    for prefix, folder in packages.items():
        section = next((body for heading, body in sections.items() if f"`{prefix}/`" in heading), "")
        for path in sorted(folder.rglob("*.py")):
            if path.name == "__init__.py" or "__pycache__" in path.parts:
                continue
            rel = path.relative_to(ROOT).as_posix()
            if f"`{rel}`" not in section and f"`{path.name}`" not in section and f"`{path.stem}`" not in section:
                missing.append(rel)
    scripts = sections.get("Tests and scripts", "") + text.split("## Tests and scripts", 1)[-1]
    missing += [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "scripts").rglob("*"))
                if p.is_file() and "__pycache__" not in p.parts
                and f"`{p.name}" not in scripts and f"`{p.relative_to(ROOT).as_posix()}" not in scripts]
    assert not missing, f"docs/architecture.md does not name {missing}"
    named = [path for body in sections.values() for path in _where(body)
             if path.startswith(("speculative/", "cli/", "tests/", "scripts/"))]
    assert [path for path in named if not (ROOT / path).exists()] == []
