"""Run pieces of a serving engine's released code on CPU, without installing the engine.

``engine_files`` fetches a release's wheel with ``pip download --no-deps`` once and keeps the few source files a
test reads in the tcal cache (``$TCAL_CACHE/engine-src/<package>-<version>/``); a test skips, with the reason,
where the download is impossible. Nothing of the engines lives in this repository.

Two ways to run their code:
- ``import_by_path``: a whole module, with its runtime-only imports (GPU kernels, distributed state, loggers)
  replaced by stubs the test names.
- ``definitions``: the named top-level functions, classes and assignments of a file, executed in a namespace the
  test supplies: for modules whose import pulls in the whole engine, and for functions a test calls directly.
``keyword_expr`` reads the expression an engine passes for one keyword argument of one call inside one method
(the ``bias=`` its attention gives its projections) so that a test can evaluate it on a config.
"""
from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path

import pytest


def engine_files(package: str, version: str, members: list[str]) -> Path:
    """The directory holding ``members`` (paths inside the wheel) of ``package==version``."""
    from tcal.utils.cache import cache_root

    root = cache_root() / "engine-src" / f"{package}-{version}"
    if all((root / m).is_file() for m in members):
        return root
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
               f"{package}=={version}", "-d", tmp]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"cannot download {package}=={version} with pip ({type(e).__name__}); its code is not run")
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode or not wheels:
            why = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no wheel"]
            pytest.skip(f"cannot download {package}=={version} with pip ({why[0]}); its code is not run")
        root.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=root.parent))
        with zipfile.ZipFile(wheels[0]) as z:
            names = set(z.namelist())
            for m in members:
                if m not in names:
                    pytest.fail(f"{package}=={version} has no {m}: the engine moved its code, update the test")
                (staging / m).parent.mkdir(parents=True, exist_ok=True)
                (staging / m).write_bytes(z.read(m))
    if root.exists():
        shutil.rmtree(root)
    os.replace(staging, root)
    return root


def stub_module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__path__ = []  # a package, so that submodules can be stubbed beneath it
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


def import_by_path(path: Path, name: str, stubs: dict[str, types.ModuleType]):
    """Execute the module at ``path`` as ``name`` with ``stubs`` in sys.modules for the duration of the import
    (the stubs and the module are removed afterwards, so that the engine's names never leak into other tests)."""
    saved = {k: sys.modules.get(k) for k in [*stubs, name]}
    try:
        sys.modules.update(stubs)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def definitions(path: Path, names: list[str], namespace: dict) -> dict:
    """Execute the top-level definitions (def, class, assignment) of ``path`` named in ``names``, in order of the
    file, in ``namespace``; returns the namespace."""
    tree = ast.parse(Path(path).read_text())
    found = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names:
            found.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            hit = [t.id for t in targets if isinstance(t, ast.Name) and t.id in names]
            if not hit:
                continue
            found += hit
        else:
            continue
        code = compile(ast.Module([node], type_ignores=[]), str(path), "exec")
        exec(code, namespace)  # noqa: S102 - the engine's own source, read for the test
    missing = set(names) - set(found)
    if missing:
        pytest.fail(f"{path.name} defines no {sorted(missing)}: the engine moved its code, update the test")
    return namespace


def _method_nodes(path: Path, cls: str, method: str):
    """Every AST node inside ``cls.method`` of the file (nothing when the class or method is gone)."""
    for c in ast.parse(Path(path).read_text()).body:
        if isinstance(c, ast.ClassDef) and c.name == cls:
            for f in c.body:
                if isinstance(f, ast.FunctionDef) and f.name == method:
                    yield from ast.walk(f)


def keyword_expr(path: Path, cls: str, method: str, call: str, keyword: str) -> str:
    """The source of the expression passed as ``keyword=`` to the call of ``call`` in ``cls.method``."""
    for node in _method_nodes(path, cls, method):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == call:
            for kw in node.keywords:
                if kw.arg == keyword:
                    return ast.unparse(kw.value)
    pytest.fail(f"{path.name}: no {call}({keyword}=...) in {cls}.{method}: the engine moved its code, update the test")


def assigned_expr(path: Path, cls: str, method: str, attribute: str) -> str:
    """The source of the expression assigned to ``self.<attribute>`` in ``cls.method``."""
    for node in _method_nodes(path, cls, method):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Attribute) and t.attr == attribute:
                    return ast.unparse(node.value)
    pytest.fail(f"{path.name}: no self.{attribute} = ... in {cls}.{method}: the engine moved its code, update the test")
