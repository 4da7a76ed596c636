"""The package is layered: every tcal module imports only from its own layer or the layers below,
and no two modules import each other, directly or through others, at module level or inside
functions. The command line builds every parser without importing torch."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
# low -> high; `tcal` itself (the package root) sits above them all
LAYERS = ("utils", "sandbox", "ops", "modules", "families", "models", "data", "engines", "evaluate", "taylor", "conversion",
          "export", "train", "report", "airgap", "recipes", "cli", "__main__")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((SRC / "tcal").rglob("*.py"))}


def _resolve(name: str, modules: dict) -> str | None:
    """The tcal module an imported dotted name refers to (a module, or the module defining a name)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path, me: str, modules: dict) -> set[str]:
    """Every tcal module ``path`` imports, anywhere in the file (function bodies included)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = me.split(".") if is_pkg else me.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name == "tcal" or name.startswith("tcal."):
                target = _resolve(name, modules)
                if target and target != me:
                    found.add(target)
    return found


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return len(LAYERS)  # the package root
    if parts[-1] == "__main__":  # `python -m tcal.<package>` runs the command line: it sits beside tcal's own
        return LAYERS.index("__main__")
    return LAYERS.index(parts[1])


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(p, m, modules) for m, p in modules.items()}


def test_every_module_belongs_to_a_layer():
    for m in _modules():
        parts = m.split(".")
        assert len(parts) == 1 or parts[1] in LAYERS, f"{m} is in no layer of {LAYERS}"


def test_no_module_imports_from_a_higher_layer():
    bad = [f"{m} (layer {LAYERS[_layer(m)] if _layer(m) < len(LAYERS) else 'tcal'}) imports {t} "
           f"(layer {LAYERS[_layer(t)] if _layer(t) < len(LAYERS) else 'tcal'})"
           for m, targets in _graph().items() for t in sorted(targets) if _layer(t) > _layer(m)]
    assert not bad, "imports from a higher layer:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_cycles_and_function_level_imports(tmp_path):
    # the checker itself: a cycle hidden in a function body and an upward import are both found
    pkg = tmp_path / "tcal"
    (pkg / "utils").mkdir(parents=True)
    (pkg / "data").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "utils" / "__init__.py").write_text("")
    (pkg / "data" / "__init__.py").write_text("")
    (pkg / "utils" / "a.py").write_text("def f():\n    from tcal.data.b import g\n")
    (pkg / "data" / "b.py").write_text("from tcal.utils.a import f\n\ndef g():\n    pass\n")
    modules = {_module_name_in(tmp_path, p): p for p in pkg.rglob("*.py")}
    graph = {m: _imports(p, m, modules) for m, p in modules.items()}
    assert graph["tcal.utils.a"] == {"tcal.data.b"}
    assert _cycles(graph) == [["tcal.data.b", "tcal.utils.a"]]


def _module_name_in(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def test_import_tcal_and_the_cli_parsers_do_not_import_torch():
    code = ("import sys, tcal, tcal.cli\n"
            "tcal.cli.build_parser()\n"
            "assert len(tcal.INITS) == 9, list(tcal.INITS)\n"
            "heavy = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]\n"
            "print(','.join(heavy))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"`tcal --help` imports {out}"


def test_auto_classes_find_tcal_hybrids_after_import_tcal_in_any_order():
    fixture = Path(__file__).resolve().parent / "fixtures" / "hybrid_v0"
    load = ("from transformers import AutoModelForCausalLM\n"
            f"m = AutoModelForCausalLM.from_pretrained({str(fixture)!r})\n"
            "print(type(m).__name__)\n")
    for before in ("import tcal\n",  # tcal first: registered when transformers' Auto modules load
                   "import tcal\nimport tcal.modules.gdn\n",  # transformers loaded inside a tcal import
                   "import transformers.models.auto.modeling_auto\nimport tcal\n",  # transformers first
                   # transformers loads its Auto modules from inside a half-imported model config
                   "import tcal\nfrom transformers import LlamaConfig, LlamaForCausalLM\n"):
        out = subprocess.run([sys.executable, "-c", before + load], capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.strip().endswith("HybridForCausalLM"), (before, out.stderr[-2000:])
        assert "after import failed" not in out.stderr, (before, out.stderr[-2000:])
