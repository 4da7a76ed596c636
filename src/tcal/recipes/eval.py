"""`tcal eval`: held-out perplexity of a saved hybrid or any teacher, with its protocol."""
from __future__ import annotations

from dataclasses import dataclass

from tcal.utils.config import DeviceArgs, arg


@dataclass
class EvalConfig(DeviceArgs):
    model: str = arg("smollm2-135m", "a saved tcal hybrid directory, or any teacher spec")
    data: str = arg("wiki:eval", "corpus spec, file path")
    window: int = arg(512, "tokens per window")
    windows: int = arg(64, "number of windows (the first N, non-overlapping)")
    dtype: str = arg("float32", "float32 or bfloat16")


def run(cfg: EvalConfig) -> dict:
    import json

    from tcal.data.teachers import load_teacher
    from tcal.evaluate import perplexity_report
    from tcal.utils.runtime import resolve_device, resolve_dtype

    model, tokenizer = load_teacher(cfg.model, dtype=resolve_dtype(cfg.dtype), device=resolve_device(cfg.device))
    rep = perplexity_report(model, tokenizer, cfg.data, window=cfg.window, windows=cfg.windows)
    print(json.dumps(rep, indent=2, default=str))
    print(f"{cfg.model}: PPL {rep['ppl']:.3f} on {cfg.data} ({cfg.windows} x {cfg.window} tokens)")
    return rep
