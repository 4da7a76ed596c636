"""The GPU machine's scripts name tests that exist, and their check steps fail loudly when no test ran (on a machine
without CUDA every CUDA test skips, which pytest counts as success)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "scripts").glob("*.sh")) + sorted((ROOT / "bench").glob("*.sh"))


def test_every_test_a_script_names_exists():
    named = {(script.name, m[1], m[2]) for script in SCRIPTS
             for m in re.finditer(r"(tests/[\w/]+\.py)(?:::(\w+))?", script.read_text())}
    assert named, "the scripts name no tests: the pattern above no longer finds them"
    for script, path, test in named:
        assert (ROOT / path).is_file(), f"{script} names {path}, which does not exist"
        if test:
            assert re.search(rf"^def {test}\(", (ROOT / path).read_text(), re.M), f"{script} names {path}::{test}"


def _cuda_tests(tmp_path, *args):
    """device_session.sh's cuda_tests function alone (sourcing the script would run its steps)."""
    body = re.search(r"^cuda_tests\(\) \{.*?^\}", (ROOT / "scripts" / "device_session.sh").read_text(), re.M | re.S)
    assert body, "device_session.sh has no cuda_tests function"
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(["bash", "-c", body[0] + '\ncuda_tests "$@"', "cuda_tests", str(tmp_path / "log"), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_check_step_fails_on_a_test_that_does_not_exist(tmp_path):
    done = _cuda_tests(tmp_path, "tests/test_evaluate.py::test_cuda_matches_cpu")
    assert done.returncode == 4 and "tests/test_evaluate.py does not exist" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA these tests run")
def test_the_check_step_fails_when_every_test_skipped(tmp_path):
    done = _cuda_tests(tmp_path, "tests/evaluate/test_perplexity.py::test_cuda_matches_cpu")
    assert done.returncode == 1 and "the CUDA tests did not run and pass" in done.stderr, done.stderr
    assert "1 skipped" in (tmp_path / "log").read_text()
