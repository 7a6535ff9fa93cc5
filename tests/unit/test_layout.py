"""The package tree: the root holds only the CLI, configs and recipes; every folder says what
it is; no import circle anywhere in eagle_ray/ (module-level or function-level imports)."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "eagle_ray"
ROOT_FILES = {"__init__.py", "cli.py", "config.py", "recipes.py"}


def _modules() -> dict[str, Path]:
    mods = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the eagle_ray modules it imports anywhere in its body (lazy imports count:
    a circle through a function-level import is still a circle in the design)."""
    mods = _modules()

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out |= {known(a.name) for a in node.names if a.name.startswith("eagle_ray")}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                if base.startswith("eagle_ray"):
                    out |= {known(f"{base}.{a.name}") if f"{base}.{a.name}" in mods else known(base)
                            for a in node.names}
        out.discard(None)
        out.discard(mod)
        graph[mod] = out
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    graph = import_graph()
    assert len(graph) > 50, "the walk found too few modules"
    assert circles(graph) == []


def test_the_check_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_package_root_holds_only_cli_configs_recipes_and_folders():
    files = {p.name for p in PKG.iterdir() if p.is_file() and p.suffix == ".py"}
    assert files == ROOT_FILES


def test_every_folder_says_what_lives_there():
    for init in sorted(PKG.rglob("__init__.py")):
        if init.parent == PKG:
            continue
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.splitlines()) == 1, f"{init}: needs a one-line docstring"


def test_common_helpers_import_no_stage_or_role_folder():
    """common/ is the bottom layer: a stage's error derives from common.errors.UserFault
    instead of common/ importing every stage to know its errors."""
    leaks = {mod: sorted(d for d in deps if not d.startswith("eagle_ray.common"))
             for mod, deps in import_graph().items() if mod.startswith("eagle_ray.common")}
    assert {m: d for m, d in leaks.items() if d} == {}


def test_the_layering_check_sees_a_lazy_import_from_common(tmp_path, monkeypatch):
    """The graph counts imports inside functions too (errors.py used to import stage errors
    lazily)."""
    src = "def f():\n    from eagle_ray.store.format import StoreError\n"
    tree_mod = PKG / "common" / "errors.py"
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: src if self == tree_mod else real(self, *a, **k))
    assert "eagle_ray.store.format" in import_graph()["eagle_ray.common.errors"]


def private_imports() -> list[str]:
    """`from eagle_ray.X import _name` anywhere in the package: a module's private names are
    its own (ruff lints private imports from third-party modules only)."""
    found = []
    for p in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("eagle_ray"):
                found += [f"{p.relative_to(PKG.parent)}: {node.module}.{a.name}"
                          for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_module_imports_another_modules_private_names():
    assert private_imports() == []
