"""Every Triton launch in the package names only parameters its kernel has.

Triton's interpreter accepts a keyword the kernel does not declare; the compiled launch raises ``KeyError`` deep in
``triton.runtime.jit``. This reads each ``kernel[grid](...)`` / ``launch(kernel)[grid](...)`` call in the source and
checks its keywords (and, where no ``*args`` are spread, its positional count) against the kernel's signature, so a
removed kernel parameter cannot survive in a launch that only the GPU would reject."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib

import pytest

import replay_compile

LAUNCH_OPTIONS = {"num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl"}
ROOT = pathlib.Path(replay_compile.__file__).parent


def _launches():
    """``(file, line, kernel name, call node, module)`` for each launch of a ``@triton.jit`` function."""
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        tree = ast.parse(path.read_text())
        module = None
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)):
                continue
            target = node.func.value
            if isinstance(target, ast.Call) and getattr(target.func, "id", None) == "launch" and target.args:
                name = ast.unparse(target.args[0])
            elif isinstance(target, (ast.Name, ast.Attribute)):
                name = ast.unparse(target)
            else:
                continue
            if module is None:
                rel = path.relative_to(ROOT.parent).with_suffix("")
                module = importlib.import_module(".".join(rel.parts))
            yield path.name, node.lineno, name, node, module


def _kernel(name, module):
    try:
        obj = eval(name, vars(module))  # noqa: S307 - a dotted name read from our own source
    except Exception:  # noqa: BLE001 - a subscript of something that is not a module attribute (a dict, a tensor)
        return None
    return obj if hasattr(obj, "fn") and hasattr(obj, "arg_names") else None


LAUNCHES = [item for item in _launches() if _kernel(item[2], item[4]) is not None]


def test_the_package_launches_kernels():
    assert len(LAUNCHES) >= 20, [f"{f}:{n}" for f, n, *_ in LAUNCHES]


@pytest.mark.parametrize("item", LAUNCHES, ids=[f"{f}:{n}:{k}" for f, n, k, *_ in LAUNCHES])
def test_launch_names_only_kernel_parameters(item):
    file, line, name, call, module = item
    params = list(inspect.signature(_kernel(name, module).fn).parameters)
    unknown = [kw.arg for kw in call.keywords if kw.arg and kw.arg not in params and kw.arg not in LAUNCH_OPTIONS]
    assert not unknown, f"{file}:{line} launches {name} with {unknown}, which it does not declare"
    if not any(isinstance(a, ast.Starred) for a in call.args):
        assert len(call.args) <= len(params), f"{file}:{line}: {len(call.args)} positional arguments for {name}"
    if not any(kw.arg is None for kw in call.keywords) and not any(isinstance(a, ast.Starred) for a in call.args):
        given = set(params[: len(call.args)]) | {kw.arg for kw in call.keywords}
        missing = [
            p
            for p in params
            if p not in given
            and inspect.signature(_kernel(name, module).fn).parameters[p].default is inspect.Parameter.empty
        ]
        assert not missing, f"{file}:{line} launches {name} without {missing}"
