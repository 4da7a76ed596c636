"""Run a function in N spawned CPU processes joined by a gloo process group, as torchrun would.

Each rank gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT on a free
port) and one thread (two processes share this machine's two cores). A rank's return value, or the
exception it ended with (type name and message), comes back to the caller; a rank that raises does
not take the others down with it, so tests can look at what the survivors did.
"""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailed:
    """What a rank ended with instead of a return value."""

    def __init__(self, err: BaseException):
        self.type, self.message = type(err).__name__, str(err)
        self.traceback = traceback.format_exc()

    def __repr__(self):
        return f"RankFailed({self.type}: {self.message})"


def _entry(rank: int, fn, world_size: int, port: int, outdir: str, args: tuple, init: bool):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    import torch

    torch.set_num_threads(1)
    result = None
    try:
        from tcal.train import distributed as D

        world = D.init_from_env("cpu", timeout_minutes=2.0) if init else None
        try:
            result = fn(world, *args) if init else fn(*args)
        finally:
            if world is not None:
                D.destroy(world)
    except BaseException as err:  # noqa: BLE001 - reported to the test
        result = RankFailed(err)
    with open(Path(outdir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)


def run_ranks(fn, world_size: int = 2, *args, init: bool = True, grace_s: float = 300.0) -> list:
    """``fn(world, *args)`` on every rank (``init=False``: ``fn(*args)``, the function joins the group
    itself, as a recipe does); returns each rank's result or :class:`RankFailed`.

    A rank still running ``grace_s`` seconds after another one ended is killed and reported as a
    ``RankFailed`` of type ``Hung``: a rank blocked in a collective its peer never joins would otherwise
    hold the test session for ever."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_entry, args=(fn, world_size, free_port(), outdir, args, init), nprocs=world_size,
                                 start_method="spawn", join=False)
        first_done = None
        while not _joined(ctx):
            if first_done is None and any((Path(outdir) / f"rank{r}.pkl").exists() for r in range(world_size)):
                first_done = time.monotonic()
            if first_done is not None and time.monotonic() - first_done > grace_s:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                for p in ctx.processes:
                    p.join()
                break
        results = []
        for r in range(world_size):
            path = Path(outdir) / f"rank{r}.pkl"
            if path.exists():
                with open(path, "rb") as f:
                    results.append(pickle.load(f))
            else:
                results.append(RankFailed(Hung(f"rank {r} still running {grace_s:.0f} s after another rank ended")))
    return results


class Hung(Exception):
    pass


def _joined(ctx) -> bool:
    from torch.multiprocessing import ProcessExitedException

    try:
        return ctx.join(timeout=5)
    except ProcessExitedException:  # killed from outside: its result file is missing
        return True
