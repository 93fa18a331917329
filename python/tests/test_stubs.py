"""The type stubs (modelcache/_core.pyi) say what the extension module has:
every function and method they declare exists with the same parameters
(names, order, which are keyword-only, which have defaults), and every
public name of the module is declared. Signatures come from
inspect.signature where the object has one, otherwise from the signature
line pybind11 writes at the top of a function's docstring.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any, List, Tuple

import modelcache
from modelcache import _core

STUB = Path(_core.__file__).with_name("_core.pyi")

# (name, keyword_only, has_default)
Param = Tuple[str, bool, bool]


def split_top_level(text: str) -> List[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    if current.strip():
        parts.append(current.strip())
    return parts


def runtime_params(obj: Any) -> List[Param]:
    try:
        sig = inspect.signature(obj)
    except (ValueError, TypeError):
        sig = None
    if sig is not None:
        return [(p.name, p.kind == p.KEYWORD_ONLY, p.default is not p.empty)
                for p in sig.parameters.values()
                if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    line = (obj.__doc__ or "").splitlines()[0]
    assert "(" in line, f"{obj!r}: no signature"
    inside = line[line.index("(") + 1:line.rindex(")")]
    params, keyword_only = [], False
    for part in split_top_level(inside):
        if part == "*":
            keyword_only = True
            continue
        name = part.split(":")[0].split("=")[0].strip()
        if name == "self":
            continue
        default = part.split("=", 1)[1].strip() if "=" in part else None
        params.append((name, keyword_only,
                       default is not None and default != "<required>"))
    return params


def stub_params(fn: ast.FunctionDef) -> List[Param]:
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [False] * (len(positional) - len(a.defaults)) + [True] * len(a.defaults)
    out = [(arg.arg, False, d) for arg, d in zip(positional, defaults)]
    out += [(arg.arg, True, d is not None) for arg, d in zip(a.kwonlyargs, a.kw_defaults)]
    return [p for p in out if p[0] != "self"]


def is_property(fn: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list)


def is_static(fn: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)


def declared() -> List[Tuple[str, Any, ast.AST]]:
    """(qualified name, runtime object, stub node) for every declaration."""
    tree = ast.parse(STUB.read_text())
    out = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out.append((node.name, getattr(_core, node.name, None), node))
        elif isinstance(node, ast.ClassDef):
            cls = getattr(_core, node.name, None)
            out.append((node.name, cls, node))
            for member in node.body:
                if isinstance(member, ast.FunctionDef):
                    obj = None if cls is None else inspect.getattr_static(cls, member.name, None)
                    out.append((f"{node.name}.{member.name}", obj, member))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.append((node.target.id, getattr(_core, node.target.id, None), node))
    return out


def test_every_declaration_exists_with_the_stubs_parameters():
    mismatches = []
    for name, obj, node in declared():
        if obj is None:
            mismatches.append(f"{name}: declared, missing from the module")
            continue
        if not isinstance(node, ast.FunctionDef):
            continue
        if is_property(node):
            if not inspect.isdatadescriptor(obj):
                mismatches.append(f"{name}: a property in the stub, not in the module")
            continue
        if is_static(node) and isinstance(obj, staticmethod):
            obj = obj.__func__
        if node.name == "__init__":
            owner = getattr(_core, name.split(".")[0])
            if owner.__init__.__doc__ is None:
                mismatches.append(f"{name}: no signature")
                continue
        elif isinstance(obj, (classmethod, staticmethod)):
            obj = obj.__func__
        want, got = stub_params(node), runtime_params(obj)
        if want != got:
            mismatches.append(f"{name}: stub {want} != module {got}")
    assert not mismatches, "\n".join(mismatches)


def test_every_public_name_of_the_module_is_declared():
    names = {n.split(".")[0] for n, _, _ in declared()}
    public = {n for n in dir(_core) if not n.startswith("__")}
    assert public - names == set()


def test_the_package_ships_the_stubs_and_py_typed():
    package = Path(modelcache.__file__).parent
    assert STUB.is_file() and (package / "py.typed").is_file()
