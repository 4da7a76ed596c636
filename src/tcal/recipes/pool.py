"""`tcal pool`: tokenise packaged real text into a distillation token pool."""
from __future__ import annotations

from dataclasses import dataclass

from tcal.utils.command_config import OutArgs, TeacherArgs, arg


@dataclass
class PoolConfig(TeacherArgs, OutArgs):
    out: str = arg("runs/pool", "pool directory (written atomically)")
    sources: str = arg("sotu,brown,python-doc,postgres-doc,linux-doc",
                       "comma-separated sources (built-in names, NAME:calib splits, dir:PATH); never evaluation text")
    max_tokens: int | None = arg(None, "stop after this many tokens")
    max_file_mb: float = arg(60.0, "largest part file in MiB (for machines that limit one transfer's size: docs/airgap.md)")
    progress: bool = arg(True, "progress bars (one per source)")


def run(cfg: PoolConfig) -> dict:
    from tcal.data.pool import build_pool
    from tcal.data.pool_sources import resolve_source
    from tcal.data.teachers import load_teacher
    from tcal.utils.atomic import check_out, written_files
    from tcal.utils.errors import TcalError

    out = check_out(cfg.out, "pool", cfg.overwrite)
    sources = tuple(s.strip() for s in cfg.sources.split(",") if s.strip())
    if not sources:
        raise TcalError("--sources is empty; e.g. --sources sotu,brown")
    for s in sources:
        resolve_source(s, None)
    if cfg.max_tokens is not None and cfg.max_tokens < 1:
        raise TcalError(f"--max-tokens must be positive, got {cfg.max_tokens}")
    if not cfg.max_file_mb > 0:
        raise TcalError(f"--max-file-mb must be positive, got {cfg.max_file_mb}")
    _, tokenizer = load_teacher(cfg.teacher)
    manifest = build_pool(tokenizer, out, sources=sources, max_tokens=cfg.max_tokens, max_file_mb=cfg.max_file_mb,
                          progress=cfg.progress)
    print(f"wrote {cfg.out}: {manifest['total_tokens']:,} tokens; files: {', '.join(written_files(out))}")
    return manifest
