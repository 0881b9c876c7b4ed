"""Tools and environments named on a command line or in a run's files: "module:function" ↔ the object.

    resolve_tools("mypkg.tools:calculator,run_python")   # [calculator, run_python]
    resolve_environment("mypkg.envs:Counter")            # the class; an instance per conversation or rollout
    tool_spec(calculator)                                # "mypkg.tools:calculator" (None if not importable)

A name is imported only because the user wrote it (as `--reward_funcs module:function` is). Every
failure is a one-line `CohortError` that names the spec and says what to fix; a tool is also checked
for a JSON schema (type hints and a Google-style docstring) here, before any model is loaded.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable

from cohort_grpo.errors import CohortError
from cohort_grpo.tools.sandbox import run_python
from cohort_grpo.tools.schema import make_tool

BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"run_python": run_python}


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _import_target(spec: str, what: str, example: str) -> Any:
    """The object `spec` ("module:attribute.path") names; `what` ("tool", "environment") and `example`
    go into the error messages."""
    module_name, colon, attribute_path = spec.partition(":")
    if not colon or not module_name or not attribute_path:
        raise CohortError(f"{what} {spec!r} is not 'module:name'; write it as e.g. {example!r}")
    # A module in the current folder resolves as it does for `python -m cohort_grpo`: the `cohort-grpo` script's own
    # folder is first on sys.path instead, and a training script's tools are recorded as `script:function`.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        target = importlib.import_module(module_name)
    except Exception as e:  # a module that fails while importing is as unusable as a missing one
        raise CohortError(f"{what} {spec!r}: cannot import module {module_name!r} ({type(e).__name__}: "
                          f"{_one_line(e)}); check the name and that its folder is on PYTHONPATH") from e
    for attribute in attribute_path.split("."):
        if not hasattr(target, attribute):
            raise CohortError(f"{what} {spec!r}: module {module_name!r} has no attribute {attribute_path!r}; "
                              f"check the name after the colon")
        target = getattr(target, attribute)
    return target


def _checked_tool(tool: Callable[..., Any], label: str) -> Callable[..., Any]:
    """`tool` itself, once a JSON schema can be made from it (else a one-line error naming `label`)."""
    if not callable(tool):
        raise CohortError(f"tool {label} is a {type(tool).__name__}, not a function; name a function")
    try:
        make_tool(tool)
    except CohortError as e:
        # schema errors read "tool <function name>: <problem; fix>"; name the spec the user wrote instead
        problem = str(e).split(": ", 1)[1] if str(e).startswith("tool ") and ": " in str(e) else str(e)
        raise CohortError(f"tool {label}: {problem}") from None
    return tool


def resolve_tools(specs) -> list[Callable[..., Any]]:
    """The tool functions `specs` names: a comma-separated string "module:function,module:function", or
    a list of such strings and/or callables; "run_python" is the built-in sandboxed Python tool. Each
    must be callable with type hints and a Google-style docstring (its JSON schema is made here)."""
    if specs is None:
        return []
    items = specs.split(",") if isinstance(specs, str) else list(specs)
    tools = []
    for item in items:
        if isinstance(item, str):
            spec = item.strip()
            if not spec:
                continue  # "a:b," or "a:b, c:d": a stray comma or space is not a tool
            if spec in BUILTIN_TOOLS:
                tools.append(BUILTIN_TOOLS[spec])
                continue
            target = _import_target(spec, "tool", "mypackage.tools:calculator")
            tools.append(_checked_tool(target, repr(spec)))
        elif callable(item):
            tools.append(_checked_tool(item, getattr(item, "__qualname__", None) or repr(item)))
        else:
            raise CohortError(f"tool {item!r} is neither 'module:function' nor a function; pass one of those")
    return tools


def resolve_environment(spec) -> type:
    """The environment class (or factory) "module:Class" names; a class given as itself is checked the same
    way. It must have a callable `reset` (TRL's `environment_factory` contract: `reset(**kwargs)` returns
    the text to append to the first user message, or None; its other public methods are the tools)."""
    if isinstance(spec, str):
        label = repr(spec.strip())
        target = _import_target(spec.strip(), "environment", "mypackage.envs:Counter")
    else:
        label = getattr(spec, "__qualname__", None) or repr(spec)
        target = spec
    if not callable(target):
        raise CohortError(f"environment {label} is a {type(target).__name__}, not a class; name a class whose "
                          "instances are the environment")
    if not callable(getattr(target, "reset", None)):
        raise CohortError(f"environment {label} has no callable reset; define reset(self, **kwargs) returning the "
                          "text to append to the first user message, or None")
    return target


def tool_spec(function: Any) -> str | None:
    """"module:qualname" for `function` (a tool, an environment class) when importing that name gives back
    the same object, so a run can record its tools by name and a later process load them; "run_python" for
    the built-in tool; None for what cannot be found again that way (a lambda, a nested function, a
    function of `__main__` or of a file run as a script, a callable object, a bound method)."""
    for name, builtin in BUILTIN_TOOLS.items():
        if function is builtin:
            return name
    module_name = getattr(function, "__module__", None)
    qualname = getattr(function, "__qualname__", None)
    if not module_name or not qualname or "<" in qualname:
        return None  # "<locals>", "<lambda>"
    if module_name == "__main__":  # another module in the process that loads the name: the script's own
        return _script_spec(function, qualname)
    try:
        target: Any = importlib.import_module(module_name)  # the loaded module itself when it is loaded
    except Exception:  # noqa: BLE001 - not importable by its name: no spec, not an error
        return None
    missing = object()
    for attribute in qualname.split("."):
        target = getattr(target, attribute, missing)
        if target is missing:
            return None
    return f"{module_name}:{qualname}" if target is function else None


def unsaved_reason(function: Any) -> str:
    """Why `tool_spec(function)` is None, and what makes the name importable: one clause for a warning."""
    qualname = getattr(function, "__qualname__", None) or ""
    name = getattr(function, "__name__", None) or type(function).__name__
    if not qualname or not getattr(function, "__module__", None):
        return f"{name} has no module-level name; make it a function (or class) defined at the top of a module"
    if "<" in qualname:
        return (f"{name} is a lambda or a function defined inside another; define it at the top level of a "
                "module (e.g. my_tools.py beside your script) and import it from there")
    if function.__module__ == "__main__":
        return _script_check(function, qualname)[0] or f"{name} cannot be imported again by name"
    return (f"{name} cannot be imported again by the name {function.__module__}:{qualname}; define it at the top "
            "level of an importable module")


def _script_spec(function: Any, qualname: str) -> str | None:
    problem, name = _script_check(function, qualname)
    return None if problem else f"{name}:{qualname}"


def _script_check(function: Any, qualname: str) -> tuple[str | None, str]:
    """(None, the import name) when a function of the script being run (`python train.py`, `python -m
    pkg.train`) can be recorded as "script:function": importing that name later is harmless (the script only
    defines things, its run guarded by `if __name__ == "__main__":`) and finds this very file (`train.py` run
    from its own folder, which chat and eval resolve names from, or the module `-m` named); else (what to
    do instead, "")."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    elsewhere = f"move {qualname} into a module of its own (e.g. my_tools.py) and import it from there"
    if not path or not str(path).endswith(".py") or "." in qualname or getattr(main, qualname, None) is not function:
        return f"{qualname} belongs to no script file that can be imported again; {elsewhere}", ""
    script = Path(path)
    spec = getattr(main, "__spec__", None)
    name = spec.name if spec is not None else script.stem
    if not all(part.isidentifier() for part in name.split(".")) or name in sys.stdlib_module_names:
        return (f"{qualname} is defined in {script.name}, whose name is not a module of its own; rename the script "
                f"or {elsewhere}"), ""
    if spec is None and script.resolve().parent != Path.cwd().resolve():
        return (f"{qualname} is defined in {script.name}, which is not in the current folder; run the script from "
                f"its folder ({script.parent}), or {elsewhere}"), ""
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        found = None
    if found is None or not found.origin or Path(found.origin).resolve() != script.resolve():
        return f"{qualname} is defined in {script.name}, which the name {name} does not import; {elsewhere}", ""
    if not _defines_only(script):
        return (f"{qualname} is defined in {script.name}, which runs code when imported; put the script's training "
                f"code under `if __name__ == \"__main__\":`, or {elsewhere}"), ""
    return None, name


def _defines_only(script: Path) -> bool:
    """Whether importing `script` only defines names: imports, functions, classes, docstrings, assignments
    that call nothing, and an `if __name__ == "__main__":` block (which an import skips)."""
    try:
        tree = ast.parse(script.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return False
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and not any(
                isinstance(child, ast.Call) for child in ast.walk(node)):
            continue
        if isinstance(node, ast.If) and _is_main_guard(node.test):
            continue
        return False
    return True


def _is_main_guard(test: ast.expr) -> bool:
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq) and len(test.comparators) == 1
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value == "__main__")
