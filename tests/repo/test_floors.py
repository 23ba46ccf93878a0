"""The floors of the installed package, read from every module's AST (function-local imports included).

Floors, lowest first: the cache library ``artcache.*`` < the drafts and their trainer ``artcache.trainers``
< the harness ``artcache.bench`` < the composition root ``artcache.app`` (with ``artcache.__main__``,
which only starts it). A module never imports a higher floor. Also: no import cycle (function-local
imports included), and no product function longer than 120 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import REPO

ROOT = REPO
FOLDERS = {"artcache": "artcache", "artcache.trainers": "trainers", "artcache.bench": "bench"}
#: highest floor first: the first prefix a module name starts with decides its floor
FLOORS = (("artcache.app", 4), ("artcache.__main__", 4), ("artcache.bench", 3), ("artcache.trainers", 2),
          ("artcache", 1))
MAX_FUNCTION_LINES = 120


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([pkg, *parts])] = path
    return out


MODULES = _modules()


def floor(module: str) -> int:
    for prefix, level in FLOORS:
        if module == prefix or module.startswith(prefix + "."):
            return level
    raise AssertionError(f"{module} is on no floor")


def _owner(name: str) -> str | None:
    """The artcache module ``name`` (a dotted import target) lives in, or None outside the package."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str, *, function_local: bool = True) -> list[tuple[int, str]]:
    """(line, artcache module) for each import in ``module``: ``from a.b import c`` counts as ``a.b.c``
    when that is a module, else ``a.b``; relative imports are resolved."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            local = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)) and (function_local or not in_function):
                if isinstance(child, ast.Import):
                    names = [a.name for a in child.names]
                else:
                    base = child.module or ""
                    if child.level:
                        anchor = package
                        for _ in range(child.level - 1):
                            anchor = anchor.rpartition(".")[0]
                        base = f"{anchor}.{base}" if base else anchor
                    names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in child.names]
                found.extend((child.lineno, m) for m in map(_owner, names) if m and m != module)
            visit(child, local)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def test_the_floors_cover_every_module_and_imports_are_seen():
    assert {floor(m) for m in MODULES} == {1, 2, 3, 4}
    assert floor("artcache.trainers.draft") == 2 and floor("artcache.logs") == 1 and floor("artcache.app.cli") == 4
    # the CLI imports the consumer inside its verb: seen only with function-local imports
    assert "artcache.trainers.consumer" in {t for _, t in imports("artcache.app.cli")}
    assert "artcache.trainers.consumer" not in {t for _, t in imports("artcache.app.cli", function_local=False)}
    # relative imports resolve to their modules
    assert {"artcache.trainers.dflash.loss", "artcache.trainers.draft"} <= {
        t for _, t in imports("artcache.trainers.dflash.adapter")}


def test_no_module_imports_a_higher_floor():
    """Library modules import neither the drafts, the harness nor the app; the drafts neither the
    harness nor the app; the harness not the app (function-local imports included)."""
    bad = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {target} (floor {floor(target)} > {floor(m)})"
           for m in MODULES for line, target in imports(m) if floor(target) > floor(m)]
    assert bad == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_at_module_level():
    graph = {m: {t for _, t in imports(m, function_local=False)} for m in MODULES}
    assert _cycles(graph) == []


def test_no_import_cycle_with_function_local_imports():
    """Anywhere in the package, the composition root included: a function-local import that runs back up
    is a cycle too (``cli -> config -> experiments -> config -> cli`` was one, issue 19)."""
    graph = {m: {t for _, t in imports(m)} for m in MODULES}
    assert _cycles(graph) == []


#: the composition root's modules, lowest first: each imports only those before it
APP_ORDER = ("artcache.app.values", "artcache.app.config", "artcache.app.experiments", "artcache.app.slurm",
             "artcache.app.cli")


def test_the_composition_root_imports_one_way():
    """``values`` < ``config`` < ``experiments`` < ``slurm`` < ``cli`` (function-local imports included), and
    config reaches ``values`` at module level (it used to borrow ``parse_bytes`` / ``parse_template_options``
    from the CLI)."""
    app = {m for m in MODULES if m.startswith("artcache.app.")}
    assert set(APP_ORDER) <= app
    rank = {m: i for i, m in enumerate(APP_ORDER)}
    up = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {t}" for m in APP_ORDER for line, t in imports(m)
          if t in rank and rank[t] >= rank[m]]
    assert up == []
    assert "artcache.app.values" in {t for _, t in imports("artcache.app.config", function_local=False)}
    assert "artcache.app.config" in {t for _, t in imports("artcache.app.experiments", function_local=False)}
    assert "artcache.app.config" in {t for _, t in imports("artcache.app.cli", function_local=False)}


def test_cycle_finder_sees_a_function_local_cycle(tmp_path, monkeypatch):
    """The import reader plus the cycle finder catch a circle closed only by a function-local import."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("import pkg.b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n    return a\n")
    fake = {"pkg.a": pkg / "a.py", "pkg.b": pkg / "b.py"}
    monkeypatch.setitem(globals(), "MODULES", fake)
    graph = {m: {t for _, t in imports(m)} for m in fake}
    assert _cycles(graph) == [["pkg.a", "pkg.b"]]
    assert _cycles({m: {t for _, t in imports(m, function_local=False)} for m in fake}) == []


#: ``path:function`` allowed over :data:`MAX_FUNCTION_LINES`, each with its reason (do not split what
#: is long because its one concept is long). Empty: every product function fits today; an entry must say why.
LONG_FUNCTIONS: dict[str, str] = {
    "trainers/dflash/loss.py:dflash_loss": "half of it is the docstring of the five loss modes and the packed "
                                           "rows' arguments; the body is one pass over the chunks",
    "trainers/dspark/loss.py:dspark_loss": "likewise: the three-term objective's docstring with the packed rows' "
                                           "and the global denominators' arguments",
    "trainers/eagle3/loss.py:eagle3_loss": "likewise: the TTT objective's docstring with the sync-free, packed, "
                                           "global-denominator and attention-chunk arguments",
}


def long_functions(modules: dict[str, Path], root: Path = ROOT) -> list[tuple[str, int, str, int]]:
    """(path, line, name, lines) of every function (methods and nested functions included) over
    :data:`MAX_FUNCTION_LINES` lines, from its ``def`` to its last line."""
    long = []
    for path in modules.values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append((str(path.relative_to(root)), node.lineno, node.name, n))
    return long


def test_long_function_finder_finds_one(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    assert long_functions({"m": tmp_path / "m.py"}, tmp_path) == [("m.py", 5, "long", MAX_FUNCTION_LINES + 1)]


def test_no_product_function_over_120_lines():
    """Every floor, the composition root included (``experiments.plan_run`` was 154 lines: its per-experiment
    checks are ``_plan_experiment`` and ``_resume_or_fresh`` now), unless :data:`LONG_FUNCTIONS` names it."""
    long = [f"{path}:{line} {name} ({n} lines)" for path, line, name, n in long_functions(MODULES)
            if f"{path}:{name}" not in LONG_FUNCTIONS]
    assert long == []
    assert all(reason for reason in LONG_FUNCTIONS.values())


def test_signal_handlers_are_installed_only_by_the_shutdown_module():
    """One signal rule: every product process installs its SIGINT/SIGTERM handling through
    :class:`artcache.shutdown.GracefulShutdown` (first signal asks, second forces, handlers restored); the
    payload holder had a handler of its own."""
    found = []
    for name, path in _modules().items():
        if name == "artcache.shutdown":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "signal" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "signal":
                found.append(f"{name}:{node.lineno}")
    assert found == []
