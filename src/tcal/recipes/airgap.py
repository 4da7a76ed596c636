"""`tcal airgap pack|stage|check`: staging tcal for a GPU machine without network (docs/airgap.md; the library is
:mod:`tcal.airgap`). ``python -m tcal.airgap`` is the same command."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from tcal.airgap import DEFAULT_CARRY, DEFAULT_STAGE, TRANSFER_MB
from tcal.airgap.carry import FLA_VERSION
from tcal.utils.command_config import DEFAULT_TEACHER, arg
from tcal.utils.errors import TcalError


@dataclass
class PackConfig:
    teacher: str = arg(DEFAULT_TEACHER, "built-in teachers to carry, comma-separated: each GGUF, its tokenizer and "
                                        "the corpora its defaults read")
    pool: str = arg("", "token pools to carry, NAME=DIR comma-separated (DIR built with tcal pool; staged as "
                        "STAGE/pools/NAME)")
    tokenizer: bool = arg(True, "carry each teacher's tokenizer as this machine's transformers converts it")
    wheels: bool = arg(True, "carry the flash-linear-attention, fla-core and gguf wheels")
    fla: str = arg(FLA_VERSION, "the flash-linear-attention / fla-core release of --wheels (0.6.0 and newer train "
                                "through fla's kernels on Hopper where Triton is 3.7.1 or newer)")
    extra_wheels: str = arg("", "more wheel files to carry, comma-separated (installed beside the others, no "
                                "dependencies): e.g. a Triton release newer than the GPU image's, for fla's Hopper "
                                "backward")
    eval_wheels: bool = arg(False, "carry lm-evaluation-harness and the packages it needs that a bare GPU image lacks")
    transfer_mb: float = arg(TRANSFER_MB, "the most one transfer may carry, in MiB: every folder stays within it")
    out: str = arg(DEFAULT_CARRY, "output directory: one numbered folder per transfer")
    overwrite: bool = arg(False, "replace an earlier pack in --out")


@dataclass
class StageConfig:
    carry: str = arg(DEFAULT_CARRY, "the transferred folders: pack's --out, or folders comma-separated")
    stage: str = arg(DEFAULT_STAGE, "this machine's stage folder (pieces waiting for the others, pools, site)")


@dataclass
class CheckConfig:
    teacher: str = arg(DEFAULT_TEACHER, "built-in teachers that must be staged, comma-separated")


def _names(spec: str) -> list[str]:
    return [s.strip() for s in spec.split(",") if s.strip()]


def _teachers(spec: str) -> list[str]:
    from tcal.data.teacher_table import TEACHERS

    names = _names(spec)
    if not names:
        raise TcalError(f"--teacher names no teacher; give built-in teachers, comma-separated: {', '.join(TEACHERS)}")
    for n in names:
        if n not in TEACHERS:
            raise TcalError(f"{n!r} is not a built-in teacher; the built-ins are {', '.join(TEACHERS)}")
    return names


def pack(cfg: PackConfig) -> list[Path]:
    import tempfile
    from importlib.metadata import version

    from tcal.airgap import carry
    from tcal.data.teacher_table import TEACHERS
    from tcal.utils.atomic import atomic_dir, check_out, write_json

    teachers = _teachers(cfg.teacher)
    pools = []
    for spec in _names(cfg.pool):
        name, eq, path = spec.partition("=")
        if not eq or not name or not (Path(path).expanduser() / "manifest.json").is_file():
            raise TcalError(f"--pool {spec}: give NAME=DIR with DIR a token pool (build one with tcal pool --teacher "
                            "TEACHER --out DIR)")
        pools.append((name, Path(path).expanduser()))
    if not (cfg.transfer_mb >= 2 and math.isfinite(cfg.transfer_mb)):  # nan compares false with everything
        raise TcalError(f"--transfer-mb must be a number of MiB of at least 2, got {cfg.transfer_mb}")
    extra = [Path(w).expanduser() for w in _names(cfg.extra_wheels)]
    for w in extra:
        if w.suffix != ".whl" or not w.is_file():
            raise TcalError(f"--extra-wheels {w}: not a wheel file (.whl); pip download one first")
    if extra and not cfg.wheels:
        raise TcalError("--extra-wheels installs beside --wheels: drop --no-wheels, or carry the extra wheels alone "
                        "with pip")
    out = check_out(cfg.out, "airgap pack", cfg.overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".tcal-pack-") as tmp:
        work = Path(tmp)
        items = [x for t in teachers for x in carry.teacher_items(t, work, cfg.tokenizer)]
        items.append(carry.data_item([TEACHERS[t] for t in teachers], work))
        items += [carry.pool_item(name, path, work) for name, path in pools]
        if cfg.wheels:
            items.append(carry.wheels_item("wheels", [*carry.fla_wheels(cfg.fla), f"gguf=={version('gguf')}"], work,
                                           files=extra))
        if cfg.eval_wheels:
            items.append(carry.wheels_item("wheels-eval", list(carry.EVAL_WHEELS), work, carry.EVAL_PLATFORM))
        with atomic_dir(out) as dst:
            dirs = carry.write_folders(items, dst, int(cfg.transfer_mb * 2**20))
            write_json(dst / "tcal_config.json", {"stage": "airgap pack", **dataclasses.asdict(cfg)})
    for d in dirs:
        d = out / d.name
        size = sum(p.stat().st_size for p in d.iterdir())
        print(f"{d}: {size / 2**20:.1f} MiB, {', '.join(sorted(p.name for p in d.iterdir() if p.name != carry.MANIFEST))}")
    print(f"wrote {cfg.out}: {len(dirs)} folders of at most {cfg.transfer_mb:g} MiB, each its own transfer; on the "
          f"GPU machine: tcal airgap stage")
    return [out / d.name for d in dirs]


def stage(cfg: StageConfig) -> list[str]:
    from tcal.airgap import carry

    root = Path(cfg.carry).expanduser()
    if "," not in cfg.carry and root.is_dir() and not (root / carry.MANIFEST).is_file():
        folders = sorted(d for d in root.iterdir() if (d / carry.MANIFEST).is_file())
    else:
        folders = [Path(f).expanduser() for f in _names(cfg.carry)]
    missing = [f for f in folders if not (f / carry.MANIFEST).is_file()]
    if not folders or missing:
        raise TcalError(f"--carry {cfg.carry}: {'no transferred folder there' if not folders else f'{missing[0]} is not one'}"
                        f"; transfer the folders tcal airgap pack wrote")
    lines = carry.stage_items(folders, Path(cfg.stage).expanduser())
    print("\n".join(lines))
    return lines


def check(cfg: CheckConfig) -> None:
    from tcal.data.teachers import builtin_gguf_path
    from tcal.utils.cache import NotInCache, cached_only

    for name in _teachers(cfg.teacher):
        try:
            with cached_only():
                builtin_gguf_path(name)
        except NotInCache:
            raise TcalError(f"the teacher {name} is not staged on this machine: transfer its folders and run tcal "
                            "airgap stage") from None


# tcal airgap COMMAND: name -> (config class, run function, help)
COMMANDS = {"pack": (PackConfig, pack, "gather and cut what a machine without network needs (a machine with network)"),
            "stage": (StageConfig, stage, "join, check and put in place what was transferred (the GPU machine)"),
            "check": (CheckConfig, check, "whether teachers are staged on this machine")}
