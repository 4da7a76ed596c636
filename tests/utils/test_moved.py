"""Modules that moved keep their old import paths (tcal.MOVED): the old name imports the very module at the new one,
by ``import`` and by ``from ... import``, and the module keeps its own name and spec."""
import importlib
import subprocess
import sys

import pytest

import tcal


@pytest.mark.parametrize("old, new", sorted(tcal.MOVED.items()))
def test_an_old_module_path_imports_the_module_where_it_lives_now(old, new):
    module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__name__ == module.__spec__.name == new


def test_from_an_old_path_imports_its_names_in_a_fresh_process():
    code = ("from tcal.evaluate.humaneval import paired\nfrom tcal.evaluate.harness import lm_eval_tasks\n"
            "import tcal.evaluate.niah as n\nimport tcal.evaluate as E\n"
            "assert n.__name__ == 'tcal.evaluate.tasks.niah.ruler' and callable(paired) and callable(lm_eval_tasks)\n"
            "assert E.perplexity.__module__ == 'tcal.evaluate.likelihood'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
