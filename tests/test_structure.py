"""The package's shape, checked statically (`ast` and `tokenize` only: nothing is imported, it runs in
well under a second).

* cohort_grpo/ keeps at most a handful of top-level modules; everything else lives in a role folder.
* The rooms of cohort_grpo/ (its folders and top-level modules) stand in one order, `ROOMS`, lowest first: a room
  imports only rooms below it, so no two rooms import each other and a reader can learn them bottom up.
* No import cycles among cohort's modules. Function-level (lazy) imports count as edges like module-level
  ones: a lazy import hides a cycle from the interpreter, not from the reader, and the aim is a clean
  layering; so do imports under `if TYPE_CHECKING:` (a type a lower layer needs belongs in that layer).
  `from pkg import name` is an edge to the module pkg.name when that is a module, else to pkg's
  __init__; `import pkg` is an edge to pkg's __init__. The implicit import of a module's parent
  packages is not counted (every module would otherwise reach cohort_grpo/__init__.py, and every package
  whose __init__ re-exports its submodules would import itself).
* No private name (one leading underscore, not a dunder) is imported from another cohort module, either
  as `from m import _name` or as `m._name` after `import m`. Importing a public name under a private
  alias (`import x as _x`) is fine.
* No issue-tracker references ("issue 7", "(issue 10)", "#12") in code comments, docstrings or strings:
  say what the code does instead.
* No function or method outside cohort_grpo/kernels/ longer than `MAX_FUNCTION_LINES` lines, its docstring included
  (from its `def` line to its last line): split it into functions that each say what they do.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "cohort_grpo"
MAX_TOP_LEVEL_MODULES = 3
MAX_FUNCTION_LINES = 80

# The rooms, lowest first. The data flow runs prompts → rollout → rewards → advantages → loss → update; a room sits
# above everything it needs: the maths of the algorithm (advantages, objectives) above only the config, the stages
# above the models they run, the plans above the stages whose allocations they count, the run above the plans, the
# loops above the run that assembles their parts, the command line at the top.
ROOMS = ("errors.py", "kernels", "config", "algorithm", "models", "parallel", "optim", "memory", "tools", "rewards",
         "tasks", "rollout", "update", "eval", "sft", "telemetry", "plans", "run", "trainer", "cli", "__main__.py")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts}


MODULES = _modules()


@functools.lru_cache(maxsize=None)
def _tree(module: str) -> ast.Module:
    return ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))


def _where(module: str, node: ast.AST) -> str:
    return f"{MODULES[module].relative_to(ROOT)}:{node.lineno}"


def _package_of(module: str) -> str:
    """The package a module's relative imports resolve against."""
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def _resolve_from(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = _package_of(module).split(".")
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str):
    """(target module, node, local name bound or None, imported name or None) for every import in `module`,
    at any depth (module level, inside functions, under `if`)."""
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    yield alias.name, node, alias.asname, None
                elif alias.name.split(".")[0] == "cohort_grpo":  # `import cohort_grpo.x.y` where y is not a file: nearest module
                    parts = alias.name.split(".")
                    while parts and ".".join(parts) not in MODULES:
                        parts.pop()
                    if parts:
                        yield ".".join(parts), node, None, None
        elif isinstance(node, ast.ImportFrom):
            source = _resolve_from(module, node)
            if source.split(".")[0] != "cohort_grpo":
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in MODULES:
                    yield submodule, node, alias.asname or alias.name, None
                elif source in MODULES:
                    yield source, node, alias.asname or alias.name, alias.name


def _graph() -> dict[str, dict[str, list[str]]]:
    """module → {imported module → [where, ...]}."""
    graph: dict[str, dict[str, list[str]]] = {m: {} for m in MODULES}
    for module in MODULES:
        for target, node, _, _ in _imports(module):
            if target != module:
                places = graph[module].setdefault(target, [])
                if _where(module, node) not in places:
                    places.append(_where(module, node))
    return graph


def _strongly_connected(graph) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one module (or a module importing itself)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(root):
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def _a_cycle(graph, component: list[str]) -> list[str]:
    """One shortest cycle through the component's first module (breadth-first inside the component)."""
    members, start = set(component), component[0]
    parents, frontier = {start: None}, [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child == start:
                    path = [node]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return list(reversed(path)) + [start]
                if child in members and child not in parents:
                    parents[child] = node
                    following.append(child)
        frontier = following
    return component


def test_few_top_level_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, (
        f"cohort_grpo/ has {len(top)} top-level modules ({', '.join(top)}); at most {MAX_TOP_LEVEL_MODULES}: "
        "move the others into a role folder"
    )


def _room(module: str) -> str | None:
    """The room of a cohort module: its folder, or its file for a top-level module; None for cohort itself."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    return parts[1] + ("" if (PACKAGE / parts[1]).is_dir() else ".py")


def test_every_room_has_a_place_in_the_order():
    rooms = {_room(m) for m in MODULES} - {None}
    assert rooms == set(ROOMS), (f"rooms without a place in ROOMS: {sorted(rooms - set(ROOMS))}; "
                                 f"places without a room: {sorted(set(ROOMS) - rooms)}")


def test_rooms_import_only_rooms_below_them():
    graph = _graph()
    upward = []
    for module, targets in graph.items():
        room = _room(module)
        for target, places in targets.items():
            other = _room(target)
            if room and other and room != other and ROOMS.index(other) > ROOMS.index(room):
                upward.append(f"  {room} imports {other}, which stands above it: {module} -> {target} ({', '.join(places)})")
    if upward:
        pytest.fail("imports up the order of rooms (move the name to the lower room, or pass it in; lazy imports "
                    "count):\n" + "\n".join(sorted(upward)), pytrace=False)


def test_the_order_check_finds_an_upward_import(monkeypatch):
    """The check above, on a made-up graph: a kernel that imports the trainer is refused."""
    fake = {"cohort_grpo.kernels.k": {"cohort_grpo.trainer.grpo_trainer": ["cohort_grpo/kernels/k.py:1"]},
            "cohort_grpo.trainer.grpo_trainer": {"cohort_grpo.kernels.k": ["cohort_grpo/trainer/grpo_trainer.py:1"]}}
    monkeypatch.setattr(sys.modules[__name__], "_graph", lambda: fake)
    with pytest.raises(pytest.fail.Exception, match="kernels imports trainer"):
        test_rooms_import_only_rooms_below_them()


def test_no_import_cycles():
    graph = _graph()
    reports = []
    for component in _strongly_connected(graph):
        cycle = _a_cycle(graph, component)
        members = set(component)
        edges = "\n".join(f"      {a} -> {b}   ({', '.join(graph[a][b])})"
                          for a in component for b in sorted(graph[a]) if b in members)
        reports.append(f"  cycle {' -> '.join(cycle)}; every import among its modules "
                       f"(cut at least one per cycle):\n{edges}")
    if reports:
        pytest.fail("import cycles among cohort's modules (lazy imports count):\n" + "\n".join(reports), pytrace=False)


def _private(name: str | None) -> bool:
    return bool(name) and name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_private_names_across_modules():
    offenders = []
    for module in MODULES:
        module_aliases = {}  # local name → cohort module it is bound to
        for target, node, local, name in _imports(module):
            if target == module:
                continue
            if _private(name) or (name is None and _private(target.rpartition(".")[2])):
                offenders.append(f"  {_where(module, node)}: imports {name or target} from {target}")
            elif name is None:
                module_aliases[local or target.split(".")[0]] = target
        if not module_aliases:
            continue
        for node in ast.walk(_tree(module)):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                chain = []
                value = node.value
                while isinstance(value, ast.Attribute):
                    chain.append(value.attr)
                    value = value.value
                if isinstance(value, ast.Name) and value.id in module_aliases:
                    dotted = ".".join([value.id] + list(reversed(chain)))
                    target = module_aliases[value.id]
                    if value.id != target.split(".")[0] or dotted in MODULES:
                        owner = target if not chain else dotted
                        offenders.append(f"  {_where(module, node)}: uses {node.attr} of {owner}")
    if offenders:
        pytest.fail("private names used across cohort modules (make them public or move the code):\n"
                    + "\n".join(sorted(offenders)), pytrace=False)


# "issue 7", "issues 3 and 5", "(issue 10)", "issue #4", "#12", "PR 3", "pull request 9", "gh-4"; not "#0" in
# format specs ("{:#06x}") nor "# 3" style numbered comments.
TRACKER = re.compile(r"\b(?:issues?|PR|pull request|bug)\s*#?\d+\b|(?<![\w{:&#])#\d+\b|\bgh-\d+\b", re.IGNORECASE)


def _texts(path: Path):
    """(line, text) of every comment and string literal (docstrings included) in a file."""
    with tokenize.open(path) as handle:
        source = handle.read()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.COMMENT, tokenize.STRING) or token.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            yield token.start[0], token.string


def test_no_tracker_references():
    offenders = []
    for module, path in MODULES.items():
        for line, text in _texts(path):
            for match in TRACKER.finditer(text):
                offenders.append(f"  {path.relative_to(ROOT)}:{line + text.count(chr(10), 0, match.start())}: "
                                 f"{match.group(0)!r}")
    if offenders:
        pytest.fail("issue-tracker references in cohort_grpo/ (say what the code does instead):\n" + "\n".join(offenders),
                    pytrace=False)


def test_tracker_pattern():
    for text in ("# issue 7", "(issue 10)", "see issues 3", "issue #4", "fixes #12", "PR 3"):
        assert TRACKER.search(text), text
    for text in ("# 3 layers", "f'{x:#06x}'", "step 100", "tissue 5", "level 2", "&#38;", "##1"):
        assert not TRACKER.search(text), text


def _long_functions(tree: ast.Module, limit: int) -> list[tuple[int, str, int]]:
    """(line, name, length) of each function in `tree`, nested ones included, longer than `limit` lines."""
    return [(node.lineno, node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= limit]


def test_no_long_functions():
    offenders = []
    for module, path in MODULES.items():
        if _room(module) == "kernels":  # hand-written kernels keep a launch's steps in one place
            continue
        for line, name, length in _long_functions(_tree(module), MAX_FUNCTION_LINES):
            offenders.append(f"  {path.relative_to(ROOT)}:{line}: {name} is {length} lines")
    if offenders:
        pytest.fail(f"functions longer than {MAX_FUNCTION_LINES} lines outside cohort_grpo/kernels/ (split them into "
                    "functions that each say what they do):\n" + "\n".join(sorted(offenders)), pytrace=False)


def test_long_function_count():
    """The measure above, on made-up source: a function of 81 lines is long, one of 80 is not (the decorator
    above its `def` does not count); a long method, and a long function nested in another, are found too."""
    def source(name: str, lines: int, indent: str = "") -> str:
        return f"{indent}def {name}():\n" + f"{indent}    x = 1\n" * (lines - 1)

    tree = ast.parse("@decorator\n" + source("fits", 80) + source("long", 81) + "class C:\n"
                     + source("method", 82, "    ") + source("outer", 2) + source("inner", 85, "    "))
    found = {name: (line, length) for line, name, length in _long_functions(tree, MAX_FUNCTION_LINES)}
    assert found == {"long": (82, 81), "method": (164, 82), "outer": (246, 87), "inner": (248, 85)}, found
