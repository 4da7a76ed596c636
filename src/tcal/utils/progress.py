"""Telling the user what a slow step is doing, without breaking progress bars."""
from __future__ import annotations

import logging
import sys

log = logging.getLogger("tcal")


def say(msg: str) -> None:
    """One line on stderr, through tqdm so that running bars stay intact."""
    log.debug(msg)
    try:
        from tqdm import tqdm

        tqdm.write(f"tcal: {msg}", file=sys.stderr)
    except Exception:  # pragma: no cover - tqdm is a dependency
        print(f"tcal: {msg}", file=sys.stderr)
