"""Files cut into pieces of at most a transfer's size, pieces grouped into transfer folders, and joined again.

A piece of item ``NAME`` is the file ``NAME.K-of-N`` (K from 1). Joining checks every piece is there, the joined
size, and the sha256 the packing side recorded; a piece that is missing, truncated or damaged is a one-line error that
names the item.
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from tcal.utils.errors import TcalError

BLOCK = 1 << 22
_PIECE = re.compile(r"^(?P<item>.+)\.(?P<k>\d+)-of-(?P<n>\d+)$")


def spans(size: int, piece_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of each piece of a ``size``-byte file cut every ``piece_bytes`` (one piece for an empty file)."""
    if piece_bytes < 1:
        raise TcalError(f"a piece must hold at least one byte, got {piece_bytes}")
    return [(o, min(piece_bytes, size - o)) for o in range(0, size, piece_bytes)] or [(0, 0)]


def piece_name(item: str, k: int, n: int) -> str:
    return f"{item}.{k}-of-{n}"


def parse_piece(name: str) -> tuple[str, int, int] | None:
    """``NAME.K-of-N`` -> (NAME, K, N), else None."""
    m = _PIECE.match(name)
    return (m["item"], int(m["k"]), int(m["n"])) if m else None


def folders(sizes: list[int], limit: int) -> list[list[int]]:
    """Indices of ``sizes`` grouped, in order, into folders of at most ``limit`` bytes each (first fit: a folder
    takes the next piece that fits; every size must itself fit)."""
    out: list[list[int]] = []
    room: list[int] = []
    for i, s in enumerate(sizes):
        if s > limit:
            raise TcalError(f"a piece of {s:,} bytes does not fit a transfer of {limit:,} bytes")
        for f, r in enumerate(room):
            if s <= r:
                out[f].append(i)
                room[f] -= s
                break
        else:
            out.append([i])
            room.append(limit - s)
    return out


def write_piece(src: Path, offset: int, length: int, dst: Path) -> None:
    with open(src, "rb") as f, open(dst, "wb") as out:
        f.seek(offset)
        left = length
        while left:
            block = f.read(min(BLOCK, left))
            if not block:
                raise TcalError(f"{src} ended {left:,} bytes early while cutting it; was it being written?")
            out.write(block)
            left -= len(block)


def join(pieces: dict[int, Path], n: int, out: Path, size: int, sha256: str, item: str) -> None:
    """Pieces 1..n of ``item`` joined into ``out`` (written beside it, renamed into place once its size and sha256
    are right); a TcalError naming what is wrong otherwise, and ``out`` not written."""
    missing = [k for k in range(1, n + 1) if k not in pieces]
    if missing:
        raise TcalError(f"{item}: piece {missing[0]} of {n} is missing; transfer the folder that holds it")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as dst:
            for k in range(1, n + 1):
                with open(pieces[k], "rb") as f:
                    while block := f.read(BLOCK):
                        h.update(block)
                        dst.write(block)
        got = tmp.stat().st_size
        if got != size:
            raise TcalError(f"{item}: its {n} pieces hold {got:,} bytes, expected {size:,}: a piece is truncated; "
                            "transfer its folders again")
        if h.hexdigest() != sha256:
            raise TcalError(f"{item}: joined from its {n} pieces it has sha256 {h.hexdigest()[:16]}..., expected "
                            f"{sha256[:16]}...: a piece is damaged; transfer its folders again")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
