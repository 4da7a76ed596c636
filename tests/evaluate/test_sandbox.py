"""Generated programs run in their own limited process: whatever they do is a failed problem with its reason,
never an error of tcal's, and nothing they start outlives them."""
import os
import subprocess
import time

import pytest

from tcal.evaluate.sandbox import Limits, run_program
from tcal.utils.errors import TcalError

QUICK = Limits(timeout_s=3.0, memory_mb=512)


@pytest.mark.parametrize("source, reason", [
    ("def f(x):\n    return x\nassert f(1) == 2, 'off by one'", "AssertionError: off by one"),
    ("def f(:\n    pass", "SyntaxError"),
    ("raise ValueError('bad input')", "ValueError: bad input"),
    ("import sys\nsys.exit(3)", "exit status 3"),
    ("x = bytearray(50 * 1024 ** 3)", "memory limit (512 MB): MemoryError"),
    ("x = []\nwhile True:\n    x.append(bytearray(10 ** 7))", "memory limit (512 MB): MemoryError"),
    ("import os\nos.fork()", "PermissionError: os.fork is switched off"),
    ("import subprocess\nsubprocess.run(['true'])", "PermissionError: subprocess.run is switched off"),
    ("import os\nos.system('true')", "PermissionError: os.system is switched off"),
    ("import shutil\nshutil.rmtree('/')", "PermissionError: shutil.rmtree is switched off"),
    ("while True:\n    print('x' * 100000)", "File too large"),
])
def test_a_failing_program_is_a_failed_outcome_with_its_reason(source, reason):
    out = run_program(source, QUICK)
    assert not out.passed and reason in out.reason, out


def test_a_passing_program_passes():
    out = run_program("def add(a, b):\n    return a + b\nassert add(2, 3) == 5\nprint('ok')", QUICK)
    assert out.passed and out.reason == "passed"


@pytest.mark.parametrize("source", ["while True:\n    pass", "import time\ntime.sleep(60)"])
def test_a_program_that_does_not_end_is_stopped_at_its_time_limit(source):
    t0 = time.perf_counter()
    out = run_program(source, Limits(timeout_s=1.5))
    assert not out.passed and out.reason == "timed out after 1.5 s"
    assert time.perf_counter() - t0 < 5


def test_a_child_started_around_the_guard_dies_with_the_program(tmp_path):
    """ctypes reaches fork past the Python-level guard; the child is in the program's process group, which is
    killed when the program is over."""
    marker = tmp_path / "alive"
    source = ("import ctypes, time\nlibc = ctypes.CDLL(None)\npid = libc.fork()\n"
              f"if pid == 0:\n    time.sleep(3)\n    open({str(marker)!r}, 'w').write('x')\n"
              "else:\n    raise SystemExit(0)\n")
    out = run_program(source, QUICK)
    assert out.passed
    time.sleep(4)
    assert not marker.exists()


def test_the_program_sees_none_of_the_users_environment_and_an_empty_directory(monkeypatch):
    monkeypatch.setenv("TCAL_TEST_SECRET", "hunter2")
    source = ("import os\nassert 'TCAL_TEST_SECRET' not in os.environ, 'leaked'\n"
              "assert sorted(os.listdir('.')) == ['program.py', 'stderr', 'stdout'], os.listdir('.')\n")
    assert run_program(source, QUICK).passed


def test_the_working_directory_is_removed_afterwards():
    out = subprocess.run(["python", "-c", "import tempfile; print(tempfile.gettempdir())"], capture_output=True,
                         text=True).stdout.strip()
    before = {p for p in os.listdir(out) if p.startswith("tcal-run-")}
    assert run_program("open('left-behind.txt', 'w').write('x')", QUICK).passed
    after = {p for p in os.listdir(out) if p.startswith("tcal-run-")}
    assert after <= before


def test_limits_are_checked():
    with pytest.raises(TcalError, match="time limit of a program must be positive"):
        Limits(timeout_s=0).check()
    with pytest.raises(TcalError, match="memory limit of a program must be at least 64 MB"):
        Limits(memory_mb=8).check()
