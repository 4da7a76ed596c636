"""The worker of tcal's sandbox (:mod:`tcal.sandbox`): the code that runs in the fresh ``python -I -S -B`` the
launcher starts for one program, before and around the answer's own code.

Never imported: the launcher runs this file's compiled code, with :mod:`tcal.sandbox.plain` and
:mod:`tcal.sandbox.guard` in front of it (``python -I -S -B -c BOOT CODE PAYLOAD_FD REQUEST_FD REPLY_FD``). The
payload (a marshalled dict: the program, the entry point, how much of an error message to send) is read to its end
and its pipe closed before any of the program's code runs; every guard is up by then. The worker holds neither the
problem's tests nor the token of a pass: it answers the checker (:mod:`tcal.sandbox.launcher`), frame by frame in
plain data (:mod:`tcal.sandbox.plain`), on its reply pipe:

- first ``("guards", SECCOMP, CAPABILITIES)``, written before the program's code runs;
- then ``("ready",)`` once the program ran and its entry point was looked up, or ``("raise", KIND, ERRNO,
  MESSAGE)``;
- then, for each call the checker sends (``(ARGS, KWARGS)``), ``("return", VALUE)``, ``("raise", KIND, ERRNO,
  MESSAGE)`` (the first built-in class of the exception, its errno, its message), or ``("not plain", WHAT)`` when
  the answer returned something that is not plain data;

and exits at the end of the request pipe. It imports nothing it does not need, because every program pays for it.
"""
import os
import sys

if "plain_dumps" not in globals():  # run alone (tests, tools): the names plain.py and guard.py give when compiled with it
    from tcal.sandbox.guard import _tcal_capabilities, _tcal_deny_syscalls, _tcal_prctl_dumpable_off, _tcal_switch_off  # noqa: F401
    from tcal.sandbox.plain import NotPlain, plain_dumps, plain_loads, read_frame, write_frame  # noqa: F401

def _tcal_exception(e, message_chars):
    """(KIND, ERRNO, MESSAGE) of an exception, read without trusting it: its first built-in class's name."""
    try:
        kind = next(c.__name__ for c in type(e).__mro__ if c.__module__ == "builtins")
        kind = kind if isinstance(kind, str) and kind.isidentifier() else "BaseException"
        # long enough that tcal blanks every value of its environment before it shortens the message
        message = " ".join(str(e).split())[:message_chars]
        if type(message) is not str:
            message = ""
        errno = e.errno if isinstance(e, OSError) and type(e.errno) is int else None
    except BaseException:  # noqa: BLE001 - a hostile exception
        kind, message, errno = "BaseException", "", None
    return "raise", kind, errno, message


def _tcal_run():
    exit_now = os._exit
    payload_fd, request_fd, reply_fd = (int(a) for a in sys.argv[1:4])
    chunks = []
    while True:
        chunk = os.read(payload_fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(payload_fd)
    import marshal

    payload = marshal.loads(b"".join(chunks))
    del chunks
    source, entry, message_chars = payload["source"], payload["entry_point"], payload["message_chars"]
    program_path = payload["program_path"]
    del payload
    _tcal_prctl_dumpable_off()
    seccomp = _tcal_deny_syscalls()
    caps = _tcal_capabilities()
    dumps, loads, send, receive = plain_dumps, plain_loads, write_frame, read_frame
    send(reply_fd, dumps(("guards", seccomp, -1 if caps is None else caps)))
    _tcal_switch_off()
    del sys.argv[1:]
    sys.path[:] = [p for p in sys.path if p and os.path.isabs(p)]
    if not os.path.exists(program_path):
        try:
            with open(program_path, "w", encoding="utf-8", errors="replace") as f:
                f.write(source)  # for tracebacks and inspect: what runs came through the pipe
        except OSError:
            pass
    namespace = {"__name__": "__main__", "__file__": program_path, "__builtins__": __builtins__}
    try:
        exec(compile(source, program_path, "exec"), namespace)
        answer = eval(entry, namespace) if entry else None  # the name as check(entry_point) would look it up
    except BaseException as e:  # noqa: BLE001 - every ending is the checker's to report
        try:
            send(reply_fd, dumps(_tcal_exception(e, message_chars)))
        except BaseException:  # noqa: BLE001
            pass
        exit_now(1)
    send(reply_fd, dumps(("ready",)))
    while True:
        request = receive(request_fd)
        if request is None:
            exit_now(0)
        try:
            args, kwargs = loads(request)
            value = answer(*args, **kwargs)
            try:
                reply = dumps(("return", value))
            except NotPlain as e:
                reply = dumps(("not plain", str(e)))
        except BaseException as e:  # noqa: BLE001 - crosses as its kind and message
            reply = dumps(_tcal_exception(e, message_chars))
        send(reply_fd, reply)


if __name__ == "__main__":
    _tcal_run()
