"""`tcal stats`: the teacher's attention statistics per layer and head, as JSON, a table and heat maps."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from tcal.utils.command_config import DeviceArgs, OutArgs, TeacherArgs, arg


@dataclass
class StatsConfig(TeacherArgs, OutArgs, DeviceArgs):
    data: str = arg("wiki:calib", "corpus the statistics are taken on (use the calibration split)")
    window: int = arg(256, "sequence length")
    windows: int = arg(4, "number of sequences")
    layers: str = arg("all", "layers to measure: all, or a list like 1,3,5")
    out: str = arg("runs/stats", "output directory: teacher_stats.json, stats.png, stats.txt")


def run(cfg: StatsConfig) -> dict:
    from tcal.conversion.policy import parse_keep
    from tcal.data.corpora import as_corpus
    from tcal.data.teachers import load_teacher
    from tcal.data.tokens import token_windows
    from tcal.report.plots import plot_stats
    from tcal.taylor.statistics import collect_stats, save_stats, summarise
    from tcal.utils.atomic import atomic_dir, check_out, write_json, written_files
    from tcal.utils.errors import TcalError
    from tcal.utils.runtime import resolve_device

    out = check_out(cfg.out, "stats", cfg.overwrite)
    layers = None if cfg.layers == "all" else parse_keep(cfg.layers, "--layers")
    if isinstance(layers, str):
        raise TcalError(f"--layers {cfg.layers!r}: give 'all' or a list like 1,3,5")
    if cfg.window < 2 or cfg.windows < 1:
        raise TcalError(f"--window must be >= 2 and --windows >= 1, got {cfg.window} and {cfg.windows}")
    as_corpus(cfg.data)
    teacher, tok = load_teacher(cfg.teacher, device=resolve_device(cfg.device))
    ids = token_windows(cfg.data, tok, window=cfg.window, n_windows=cfg.windows)
    t0 = time.perf_counter()
    stats = collect_stats(teacher, ids, layers)
    seconds = time.perf_counter() - t0
    text = summarise(stats)
    with atomic_dir(out) as tmp:
        save_stats(stats, tmp / "teacher_stats.json")
        plot_stats(stats, tmp / "stats.png")
        (tmp / "stats.txt").write_text(text + "\n")
        write_json(tmp / "tcal_config.json", {"stage": "stats", "seconds": seconds, **dataclasses.asdict(cfg)})
    print(text)
    print(f"{len(stats)} layers in {seconds:.1f} s ({seconds / max(len(stats), 1):.2f} s/layer)")
    print(f"wrote {cfg.out}: {', '.join(written_files(out))}")
    return {"seconds": seconds}
