"""`tcal pool`: tokenise packaged real text into a distillation token pool."""
from __future__ import annotations

from dataclasses import dataclass

from tcal.utils.config import TeacherArgs, arg


@dataclass
class PoolConfig(TeacherArgs):
    out: str = arg("runs/pool", "pool directory (written atomically)")
    sources: str = arg("sotu,brown,python-doc,postgres-doc,linux-doc",
                       "comma-separated sources (built-in names, NAME:calib splits, dir:PATH); never evaluation text")
    max_tokens: int | None = arg(None, "stop after this many tokens")
    max_file_mb: float = arg(60.0, "largest part file in MiB (the GPU machine takes 64 MiB per call)")


def run(cfg: PoolConfig) -> dict:
    from tcal.data.pool import build_pool
    from tcal.data.teachers import load_teacher

    _, tokenizer = load_teacher(cfg.teacher)
    sources = tuple(s.strip() for s in cfg.sources.split(",") if s.strip())
    return build_pool(tokenizer, cfg.out, sources=sources, max_tokens=cfg.max_tokens, max_file_mb=cfg.max_file_mb)
