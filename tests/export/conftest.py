"""The export tests' fixtures (their hybrids: helpers.target_hybrid)."""
import logging

import pytest


@pytest.fixture(autouse=True)
def _log_handlers_on_this_tests_stderr():
    """Logging handlers keep the stderr they were made with: tcal's CLI (logging.basicConfig) and transformers make
    theirs in whichever test first logs, pytest closes that test's stream when it ends, and a warning logged in a
    later test (transformers' first Qwen3.5 forward in the process) then prints a logging traceback. Each test
    points them at its own stderr."""
    import sys

    for name in ("", "transformers"):
        for h in logging.getLogger(name).handlers:
            if type(h) is logging.StreamHandler:
                h.stream = sys.stderr  # not setStream: it flushes the closed stream first
                if "flush" in vars(h):  # transformers binds its handler's flush to the stderr of its day
                    h.flush = sys.stderr.flush
    yield


@pytest.fixture(params=[False, True], ids=["no-conv", "short-conv"])
def short_conv(request):
    return request.param
