"""The attacks of a program written to be scored as passing (issue 64), each a failed (or contained) problem while a
right answer run beside it still passes: the verdict out of the program's reach (the checker apart from the worker),
a root of its own, caps it cannot outgrow. Where this machine lacks a kernel feature, the test says so and skips;
the attacks on the verdict itself fail in every mode, because the checker is a process of its own there too."""
import ctypes
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tcal.sandbox import cgroups
from tcal.sandbox import core as sandbox
from tcal.sandbox.core import Limits, run_program
from tcal.sandbox.plain import NotPlain, plain_dumps, plain_loads

HAS_NAMESPACES = sandbox.isolation()["namespaces"]
HAS_CGROUPS = bool(cgroups.available()["version"])
needs_namespaces = pytest.mark.skipif(not HAS_NAMESPACES, reason="this machine refuses namespaces "
                                      f"({sandbox.isolation()['refused']}): no root of its own, no tmpfs")
needs_cgroups = pytest.mark.skipif(not (HAS_CGROUPS and HAS_NAMESPACES), reason="no cgroup caps on this machine "
                                   f"({cgroups.available()['refused']}), or no namespaces")

PROMPT = "def helper(x):\n    return x + 1\n\n\ndef add(a, b):\n    \"\"\"a + b\"\"\"\n"
TESTS = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert helper(candidate(2, 2)) == 5\n"
WRONG = PROMPT + "    return a - b\n"
RIGHT = PROMPT + "    return helper(a + b) - 1\n"  # the answer may use the prompt's helper: its worker holds it
LIMITS = Limits(timeout_s=5.0, memory_mb=256, processes=16, disk_mb=64)


@pytest.fixture(params=["namespaces", "process guards"])
def mode(request, monkeypatch):
    if request.param == "namespaces" and not HAS_NAMESPACES:
        pytest.skip("this machine refuses namespaces")
    if request.param == "process guards":
        monkeypatch.setattr(sandbox, "_ISOLATION", {"namespaces": False, "refused": "switched off by the test"})
    return request.param


def scored(source, limits=LIMITS):
    return run_program(source, limits, tests=TESTS, entry_point="add", prompt=PROMPT)


def beside(attack, limits=LIMITS, neighbour_limits=LIMITS):
    """The attack and a right answer, run at the same time: (the attack's outcome, the right answer's)."""
    with sandbox.shielded(), ThreadPoolExecutor(2) as pool:
        a = pool.submit(scored, attack, limits)
        time.sleep(0.3)  # the attack is under way when the neighbour starts
        b = pool.submit(scored, RIGHT, neighbour_limits)
        return a.result(), b.result()


def test_plain_data_round_trips_and_nothing_else_crosses():
    value = [None, True, 0, -2 ** 70, 1.5, float("-inf"), 2j, "é\ud800", b"\x00", (1, (2,)), {1: {"a": {3}}}, set()]
    assert plain_loads(plain_dumps(value)) == value
    assert type(plain_loads(plain_dumps((1,)))) is tuple

    class Int(int):
        def __eq__(self, other):
            return True

    nested = []
    for _ in range(200):
        nested = [nested]
    for bad in (Int(3), lambda: 1, object(), frozenset(), nested, [print]):
        with pytest.raises(NotPlain):
            plain_dumps(bad)
    for bad in (b"", b"Z", b"i" + (1 << 40).to_bytes(8, "little"), plain_dumps(1) + b"N", b"S" + (1).to_bytes(8,
                "little") + plain_dumps([1]), b"l" + (10 ** 9).to_bytes(8, "little")):
        with pytest.raises(NotPlain):
            plain_loads(bad)


ALWAYS_EQUAL = ("class Anything:\n    def __eq__(self, o):\n        return True\n    __ne__ = lambda s, o: False\n"
                "    __abs__ = lambda s: 0\n    __sub__ = __rsub__ = lambda s, o: s\n    __lt__ = __le__ = __eq__\n"
                "    __hash__ = lambda s: 0\n\n\ndef add(a, b):\n    return Anything()\n")
EXEC_SWAP = "import builtins\nbuiltins.exec = lambda *a, **k: None\nbuiltins.eval = lambda *a, **k: None\n"
# the test's candidate swapped, in check's frame, for one whose answers compare equal to anything
SETTRACE = ALWAYS_EQUAL.replace("def add(a, b):\n    return Anything()\n", "") + (
    "import sys, ctypes\ndef tracer(frame, event, arg):\n    if frame.f_code.co_name == 'check':\n"
    "        frame.f_locals['candidate'] = lambda *a: Anything()\n"
    "        ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))\n"
    "    return tracer\nsys.settrace(tracer)\n")
TOKEN_FROM_FRAMES = ("import os, sys, re\nf, found = sys._getframe(), set()\nwhile f is not None:\n"
                     "    for v in list(f.f_locals.values()) + list(f.f_globals.values()):\n"
                     "        if isinstance(v, (str, bytes)) and len(v) == 32:\n            found.add(v)\n"
                     "    f = f.f_back\nfor fd in range(3, 32):\n    for t in found:\n        try:\n"
                     "            os.write(fd, t if isinstance(t, bytes) else t.encode())\n        except OSError:\n"
                     "            pass\nos._exit(0)\n")
# one input-independent answer: the expected value read off the assert being evaluated, in its caller's frame
ASSERT_FROM_FRAME = ("import sys, linecache, re\n\ndef add(a, b):\n    f = sys._getframe(1)\n    while f is not None:\n"
                     "        line = linecache.getline(f.f_code.co_filename, f.f_lineno)\n"
                     "        m = re.search(r'==\\s*(.+)$', line)\n        if m:\n"
                     "            return eval(m.group(1), f.f_globals, f.f_locals)\n        f = f.f_back\n"
                     "    return None\n")
HELPERS = "def helper(x):\n    return 5\n"  # with a - b: helper(0) == 5 would pass the second assert, not the first


@pytest.mark.parametrize("name, code, reason", [
    ("always equal", ALWAYS_EQUAL, "failed: TypeError: the answer returned a Anything, not plain data"),
    ("builtins.exec swapped", EXEC_SWAP, "failed: "),  # its own lookup of add breaks, or the assert fails
    ("sys.settrace", SETTRACE, "failed: AssertionError"),
    ("the token from its frames, then os._exit(0)", TOKEN_FROM_FRAMES, "exited before check returned (status 0)"),
    ("the assert read from the runner's frame", ASSERT_FROM_FRAME, "failed: AssertionError"),
    ("the prompt's helpers redefined", HELPERS, "failed: AssertionError"),
])
def test_the_verdict_is_out_of_the_programs_reach(mode, name, code, reason):
    """The checker holds the tests, the prompt's helpers and the token; the worker only answers calls in plain
    data: in every mode."""
    attack, right = beside(WRONG + code)
    assert not attack.passed and attack.reason.startswith(reason), (name, attack)
    assert right.passed, right


def test_a_test_that_passes_the_answer_a_function_fails_with_its_reason():
    """Only plain data crosses: a problem whose tests hand the answer a function cannot be scored here, and fails
    saying so (the function never reaches the answer's process)."""
    tests = "def check(candidate):\n    assert candidate(lambda: 1, 2) == 3\n"
    out = run_program(RIGHT, LIMITS, tests=tests, entry_point="add", prompt=PROMPT)
    assert out.reason.startswith("failed: TypeError: the tests passed the answer a function"), out


def test_the_answers_exceptions_cross_as_their_kind_and_message():
    out = scored(PROMPT + "    raise KeyError('no such key')\n")
    assert out.reason == "failed: KeyError: 'no such key'", out
    tests = "def check(candidate):\n    try:\n        candidate(1, 0)\n    except ZeroDivisionError:\n        pass\n"
    assert run_program(PROMPT + "    return a / b\n", LIMITS, tests=tests, entry_point="add", prompt=PROMPT).passed


@needs_namespaces
def test_the_answer_key_on_disk_is_out_of_sight(tmp_path):
    """The canonical solutions where tcal caches them (here: a file of the test's), the home directory, Python's
    packages: none of them exist in the program's root."""
    key = tmp_path / "HumanEval.jsonl"
    key.write_text(RIGHT)
    attack = (f"import os, sys\nfor p in ({str(key)!r}, os.path.expanduser('~root'), '/root/.cache'):\n"
              "    if os.path.exists(p) and os.path.isfile(p):\n        exec(open(p).read())\n"
              "assert not any(os.listdir(p) for p in sys.path if 'site-packages' in p and os.path.isdir(p))\n")
    out, right = beside(WRONG + attack)
    assert out.reason == "failed: AssertionError", out
    assert right.passed, right
    probe = run_program(f"import os\nassert not os.path.exists({str(tmp_path)!r})\n"
                        f"assert not os.path.exists({os.path.expanduser('~')!r} + '/.cache')\n", LIMITS)
    assert probe.passed, probe


def _keyring():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        key = libc.syscall(248, b"user", b"tcal-test-secret", b"s3cr3t-keyring-value", 20, -3)  # add_key, session
        return (libc, key) if key > 0 else None
    except OSError:
        return None


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the test calls the x86-64 keyring syscalls")
def test_the_kernels_keyring_is_refused(mode):
    found = _keyring()
    if found is None:
        pytest.skip("this machine refuses add_key to the test itself")
    libc, key = found
    try:
        attack = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"
                  "buf = ctypes.create_string_buffer(256)\n"
                  f"got = libc.syscall(250, 11, {key}, buf, 256)\n"  # KEYCTL_READ the caller's key
                  "planted = libc.syscall(248, b'user', b'tcal-planted', b'x', 1, -3)\n"
                  "raise ValueError('read %d %r planted %d' % (got, buf.value, planted))\n")
        out, right = beside(WRONG + attack)
        assert out.reason == "failed: ValueError: read -1 b'' planted -1", out
        assert "s3cr3t" not in out.reason and right.passed
        assert libc.syscall(249, b"user", b"tcal-planted", None, 0) < 0  # request_key: nothing was planted
    finally:
        libc.syscall(250, 3, key)  # KEYCTL_REVOKE


@needs_namespaces
def test_files_fill_only_its_own_tmpfs():
    """100 MB written into a 64 MB working directory: no space left there, none taken from the machine's disk."""
    attack = ("import os\ntry:\n    for i in range(100):\n        with open('f%d' % i, 'wb') as f:\n"
              "            f.write(b'x' * (1 << 20))\nexcept OSError as e:\n    assert e.errno == 28, e\n"
              "    raise\n")
    out, right = beside(WRONG + attack)
    assert out.reason.startswith("failed: OSError: [Errno 28] No space left on device"), out
    assert right.passed, right


@needs_cgroups
def test_memfd_memory_counts_against_the_memory_cap():
    attack = ("import os\nfds = []\nfor i in range(64):\n    fd = os.memfd_create('m%d' % i)\n"
              "    os.write(fd, b'x' * (16 << 20))\n    fds.append(fd)\n")
    out, right = beside(WRONG + attack, Limits(timeout_s=10.0, memory_mb=256))
    assert not out.passed and out.reason.startswith(("memory limit", "failed: MemoryError", "failed: OSError")), out
    assert right.passed, right


@needs_cgroups
def test_children_share_one_memory_cap():
    attack = ("import posix, time\nfor _ in range(4):\n    if posix.fork() == 0:\n"
              "        x = bytearray(150 << 20)\n        for i in range(0, len(x), 4096):\n            x[i] = 1\n"
              "        time.sleep(30)\n        posix._exit(0)\ntime.sleep(30)\n")
    limits = Limits(timeout_s=4.0, memory_mb=256)
    with sandbox.shielded(), ThreadPoolExecutor(2) as pool:
        a = pool.submit(scored, WRONG + attack, limits)
        g = None
        time.sleep(2.5)
        b = pool.submit(scored, RIGHT)
        out, right = a.result(), b.result()
    assert not out.passed and out.guards["all_processes_ended"], (out, g)
    assert right.passed, right


@needs_cgroups
@pytest.mark.parametrize("attack", [
    "import posix\nwhile True:\n    posix.fork()\n",  # a fork bomb
    "import posix, time\nkids = []\nfor _ in range(1000):\n    pid = posix.fork()\n    if pid == 0:\n"
    "        time.sleep(30)\n        posix._exit(0)\n    kids.append(pid)\n",  # many children
])
def test_processes_are_capped_per_program(attack):
    out, right = beside(WRONG + attack, Limits(timeout_s=3.0, memory_mb=256, processes=16))
    assert not out.passed and out.guards["all_processes_ended"], out
    assert right.passed, right


@needs_cgroups
def test_busy_processes_leave_the_neighbour_its_share():
    """Twelve busy processes of one program share its one CPU; a right answer that needs some CPU itself finishes
    well inside its time beside them."""
    hog = "import posix\nfor _ in range(12):\n    if posix.fork() == 0:\n        while True:\n            pass\n" \
          "while True:\n    pass\n"
    busy_right = RIGHT + "sum(i * i for i in range(3_000_000))\n"
    with sandbox.shielded(), ThreadPoolExecutor(2) as pool:
        a = pool.submit(scored, WRONG + hog, Limits(timeout_s=8.0, memory_mb=256, processes=16))
        time.sleep(1.0)
        b = pool.submit(scored, busy_right, Limits(timeout_s=6.0, memory_mb=256))
        out, right = a.result(), b.result()
    assert out.reason == "timed out after 8 s", out
    assert right.passed, right


@needs_namespaces
def test_a_deep_directory_chain_is_gone_with_its_namespace():
    """Nested directories made until the time runs out: they live in the program's tmpfs, which the kernel drops
    with its mount namespace; the run ends within seconds of its time limit."""
    attack = "import posix\ni = 0\nwhile True:\n    posix.mkdir('d')\n    posix.chdir('d')\n    i += 1\n"
    t0 = time.perf_counter()
    out, right = beside(WRONG + attack, Limits(timeout_s=3.0, memory_mb=256))
    assert not out.passed and time.perf_counter() - t0 < 20, out
    assert right.passed, right


def test_strict_refuses_to_run_without_cgroup_caps_and_the_report_says_which_caps_held(monkeypatch):
    from tcal.utils.errors import TcalError

    if HAS_NAMESPACES:
        line = sandbox.describe(sandbox.guards())
        assert ("caps: memory 1024 MB for all its processes" if HAS_CGROUPS else "caps: memory 1024 MB of address "
                "space per process (rlimit)") in line
    monkeypatch.setattr(cgroups, "_FOUND", {"version": None, "refused": "cgroup v1: not mounted"})
    with pytest.raises(TcalError, match=r"--sandbox strict runs programs only under cgroup caps .*cgroup v1: not "
                                        r"mounted"):
        run_program("pass", LIMITS, sandbox="strict")
    caps = sandbox.caps(Limits(), namespaces=False)
    assert caps["cgroups"] is None and "rlimit" in caps["memory"] and "no cap on the directory" in caps["disk"]
