"""`tcal` command line. Every subcommand maps its flags onto one typed config dataclass."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tcal.config import add_dataclass_args, arg, from_args
from tcal.errors import TcalError

log = logging.getLogger("tcal")


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise TcalError(f"--device {device} asked for but CUDA is not available; use --device cpu")
    return device


def resolve_dtype(name: str):
    import torch

    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise TcalError(f"unknown --dtype {name!r}; choose float32 or bfloat16")
    return table[name]


def parse_keep(spec: str) -> list[int] | str:
    """'0,4,8' -> [0, 4, 8]; anything else (a policy such as 'uniform:8') is passed through."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if parts and all(p.lstrip("-").isdigit() for p in parts):
        return [int(p) for p in parts]
    return spec


# ---------------------------------------------------------------------------------------------
# tcal convert
# ---------------------------------------------------------------------------------------------


@dataclass
class ConvertConfig:
    teacher: str = arg("smollm2-135m", "teacher: built-in name, local HF directory, .gguf file or hub id")
    keep: str = arg("0,2,4,6,8,10,12,14,16,18,20,22,24,26,28",
                    "layers kept as softmax attention: a list like 0,4,8")
    init: str = arg("copy", "initialisation of the GDN layers")
    out: str = arg("runs/convert", "output directory (written atomically)")
    calib: str = arg("wiki:calib", "calibration corpus (Taylor-Calibrate inits only); disjoint from --eval")
    calib_window: int = arg(256, "calibration sequence length (reference: 256)")
    calib_windows: int = arg(4, "calibration sequences (reference: 4)")
    align_steps: int = arg(300, "Phase 2 steps per layer (reference: 300)")
    eval: str = arg("wiki:eval", "held-out corpus for the report's perplexity; 'none' to skip")
    eval_window: int = arg(512, "evaluation window length in tokens")
    eval_windows: int = arg(64, "number of evaluation windows")
    use_short_conv: bool = arg(False, "causal depthwise short conv (width 4) before q/k/v activations")
    output_gate: bool = arg(True, "SiLU output gate (W_g) on the per-head RMSNorm")
    device: str = arg("auto", "cpu, cuda, cuda:N or auto")
    dtype: str = arg("float32", "weights dtype: float32 or bfloat16")
    seed: int = arg(0, "seed for the random parts of the initialisation")


def cmd_convert(cfg: ConvertConfig) -> Path:
    import torch

    import tcal
    from tcal.atomic import atomic_dir, write_json
    from tcal.data import check_disjoint
    from tcal.teachers import load_teacher

    if cfg.eval.lower() != "none":
        check_disjoint(cfg.calib, cfg.eval, role="calibration")
    device, dtype = resolve_device(cfg.device), resolve_dtype(cfg.dtype)
    t0 = time.perf_counter()
    teacher, tokenizer = load_teacher(cfg.teacher, dtype=dtype, device=device)
    timings = {"load_teacher_s": time.perf_counter() - t0}
    t0 = time.perf_counter()
    extra, stats = {}, None
    from tcal.convert import UNCALIBRATED

    if cfg.init not in UNCALIBRATED:
        from tcal.align import AlignConfig
        from tcal.convert import calibration_ids
        from tcal.stats import collect_stats

        calib_ids = calibration_ids(cfg.calib, tokenizer, cfg.calib_window, cfg.calib_windows)
        t1 = time.perf_counter()
        stats = collect_stats(teacher, calib_ids)  # every layer: one teacher pass, saved with the hybrid
        timings["stats_s"] = time.perf_counter() - t1
        extra = {"align": AlignConfig(steps=cfg.align_steps), "calib_ids": calib_ids, "stats": stats}
    hybrid = tcal.convert(
        teacher, keep=parse_keep(cfg.keep), init=cfg.init, seed=cfg.seed, calib=cfg.calib, tokenizer=tokenizer,
        use_short_conv=cfg.use_short_conv, output_gate=cfg.output_gate, progress=True, **extra,
    )
    timings["convert_s"] = time.perf_counter() - t0
    record = hybrid.tcal_record
    report = {"teacher": cfg.teacher, "init": cfg.init, "layer_types": hybrid.config.layer_types,
              "timings": {**timings, **record["timings"]}, "selection": record.get("selection"),
              "calibration": record.get("calibration")}
    if cfg.eval.lower() != "none":
        from tcal.data import as_corpus
        from tcal.evaluate import perplexity_report

        corpus = as_corpus(cfg.eval)  # read once for both models
        report["eval"] = {
            name: perplexity_report(model, tokenizer, corpus, window=cfg.eval_window, windows=cfg.eval_windows)
            for name, model in (("teacher", teacher), ("hybrid", hybrid))
        }
    with atomic_dir(cfg.out) as tmp, torch.no_grad():
        hybrid.save_pretrained(tmp, atomic=False)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_json(tmp / "tcal_config.json", {"stage": "convert", **dataclasses.asdict(cfg)})
        write_json(tmp / "report.json", report)
        (tmp / "report.md").write_text(convert_markdown(cfg, report))
        if stats is not None:
            from tcal.stats import save_stats

            save_stats(stats, tmp / "teacher_stats.json")
    print(f"wrote {cfg.out}: {len(hybrid.config.gdn_layers)} GDN layers, "
          f"attention kept at {hybrid.config.attention_layers}")
    for name, r in report.get("eval", {}).items():
        print(f"  {name}: held-out PPL {r['ppl']:.2f} on {cfg.eval}")
    return Path(cfg.out)


def convert_markdown(cfg: ConvertConfig, report: dict) -> str:
    lt = report["layer_types"]
    lines = [f"# tcal convert: {cfg.teacher} -> hybrid ({cfg.init})", "",
             f"- attention kept at {[i for i, t in enumerate(lt) if t != 'linear_attention']}, "
             f"{lt.count('linear_attention')}/{len(lt)} layers converted to Gated DeltaNet"]
    if report.get("calibration"):
        c = report["calibration"]
        lines.append(f"- calibration data: `{c['data']}`, {c['sequences']} x {c['tokens_per_sequence']} tokens")
    if report.get("eval"):
        lines.append(f"- evaluation data (held out, disjoint from calibration): `{cfg.eval}`, "
                     f"first {cfg.eval_windows} x {cfg.eval_window} tokens")
        lines += ["", "| model | held-out PPL |", "|---|---:|"]
        lines += [f"| {name} | {r['ppl']:.2f} |" for name, r in report["eval"].items()]
    lines += ["", "| stage | seconds |", "|---|---:|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in report["timings"].items()]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# tcal stats
# ---------------------------------------------------------------------------------------------


@dataclass
class StatsConfig:
    teacher: str = arg("smollm2-135m", "teacher spec")
    data: str = arg("wiki:calib", "corpus the statistics are taken on (use the calibration split)")
    window: int = arg(256, "sequence length")
    windows: int = arg(4, "number of sequences")
    layers: str = arg("all", "layers to measure: all, or a list like 1,3,5")
    out: str = arg("runs/stats", "output directory: teacher_stats.json, stats.png, stats.txt")
    device: str = arg("auto", "cpu, cuda, cuda:N or auto")


def cmd_stats(cfg: StatsConfig) -> dict:
    from tcal.atomic import atomic_dir, write_json
    from tcal.data import token_windows
    from tcal.stats import collect_stats, plot_stats, save_stats, summarise
    from tcal.teachers import load_teacher

    teacher, tok = load_teacher(cfg.teacher, device=resolve_device(cfg.device))
    layers = None if cfg.layers == "all" else parse_keep(cfg.layers)
    if isinstance(layers, str):
        raise TcalError(f"--layers {cfg.layers!r}: give 'all' or a list like 1,3,5")
    ids = token_windows(cfg.data, tok, window=cfg.window, n_windows=cfg.windows)
    t0 = time.perf_counter()
    stats = collect_stats(teacher, ids, layers)
    seconds = time.perf_counter() - t0
    text = summarise(stats)
    with atomic_dir(cfg.out) as tmp:
        save_stats(stats, tmp / "teacher_stats.json")
        plot_stats(stats, tmp / "stats.png")
        (tmp / "stats.txt").write_text(text + "\n")
        write_json(tmp / "tcal_config.json", {"stage": "stats", "seconds": seconds, **dataclasses.asdict(cfg)})
    print(text)
    print(f"{len(stats)} layers in {seconds:.1f} s ({seconds / max(len(stats), 1):.2f} s/layer); wrote {cfg.out}")
    return {"seconds": seconds}


# ---------------------------------------------------------------------------------------------
# tcal eval
# ---------------------------------------------------------------------------------------------


@dataclass
class EvalConfig:
    model: str = arg("smollm2-135m", "a saved tcal hybrid directory, or any teacher spec")
    data: str = arg("wiki:eval", "corpus spec, file path")
    window: int = arg(512, "tokens per window")
    windows: int = arg(64, "number of windows (the first N, non-overlapping)")
    device: str = arg("auto", "cpu, cuda, cuda:N or auto")
    dtype: str = arg("float32", "float32 or bfloat16")


def cmd_eval(cfg: EvalConfig) -> dict:
    import json

    from tcal.evaluate import perplexity_report
    from tcal.teachers import load_teacher

    model, tokenizer = load_teacher(cfg.model, dtype=resolve_dtype(cfg.dtype), device=resolve_device(cfg.device))
    rep = perplexity_report(model, tokenizer, cfg.data, window=cfg.window, windows=cfg.windows)
    print(json.dumps(rep, indent=2, default=str))
    print(f"{cfg.model}: PPL {rep['ppl']:.3f} on {cfg.data} ({cfg.windows} x {cfg.window} tokens)")
    return rep


# ---------------------------------------------------------------------------------------------
# tcal pool
# ---------------------------------------------------------------------------------------------


@dataclass
class PoolConfig:
    out: str = arg("runs/pool", "pool directory (written atomically)")
    teacher: str = arg("smollm2-135m", "teacher whose tokenizer tokenises the pool")
    sources: str = arg("sotu,brown,python-doc,postgres-doc,linux-doc",
                       "comma-separated sources (built-in names, NAME:calib splits, dir:PATH); never evaluation text")
    max_tokens: int | None = arg(None, "stop after this many tokens")
    max_file_mb: float = arg(60.0, "largest part file in MiB (the GPU machine takes 64 MiB per call)")


def cmd_pool(cfg: PoolConfig) -> dict:
    from tcal.pool import build_pool
    from tcal.teachers import load_teacher

    _, tokenizer = load_teacher(cfg.teacher)
    sources = tuple(s.strip() for s in cfg.sources.split(",") if s.strip())
    return build_pool(tokenizer, cfg.out, sources=sources, max_tokens=cfg.max_tokens, max_file_mb=cfg.max_file_mb)


COMMANDS = {
    "convert": (ConvertConfig, cmd_convert, "convert a teacher into a hybrid and save it"),
    "eval": (EvalConfig, cmd_eval, "held-out perplexity of a hybrid or teacher"),
    "pool": (PoolConfig, cmd_pool, "tokenise packaged real text into a distillation token pool"),
}


def _register_training_commands() -> None:
    from tcal.ablate import AblateConfig, run_ablate
    from tcal.distill import DistillConfig, run_distill
    from tcal.recover import RecoverConfig, run_recover

    COMMANDS["stats"] = (StatsConfig, cmd_stats, "teacher attention statistics per layer and head, with heat maps")
    COMMANDS["ablate"] = (AblateConfig, run_ablate,
                          "every init strategy on the same layers and data: held-out PPL table, plot")
    COMMANDS["distill"] = (DistillConfig, run_distill, "distil a hybrid against its frozen teacher's logits")
    COMMANDS["recover"] = (RecoverConfig, run_recover,
                           "per init: convert, distil on the same data/budget, tabulate tokens to recovery targets")


_register_training_commands()


# `tcal eval MODEL`, `tcal distill HYBRID`, `tcal stats TEACHER`: the first positional fills this field.
POSITIONAL = {"eval": "model", "distill": "hybrid", "stats": "teacher"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tcal",
        description="Convert Transformer LMs into hybrid attention / Gated DeltaNet models (Taylor-Calibrate).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (cls, _, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name in POSITIONAL:
            field = POSITIONAL[name]
            p.add_argument("positional", nargs="?", metavar=field.upper(), help=f"same as --{field}")
        add_dataclass_args(p, cls)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if ns.verbose else logging.INFO, format="%(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # weight-loading bars on every load; tcal shows its own progress
    if ns.command is None:
        parser.print_help()
        return 0
    cls, fn, _ = COMMANDS[ns.command]
    if getattr(ns, "positional", None):
        setattr(ns, POSITIONAL[ns.command], ns.positional)
    try:
        fn(from_args(cls, ns))
    except TcalError as err:
        print(f"tcal: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        hint = " (rerun with --resume to continue from the last checkpoint)" if ns.command in ("distill", "recover") else ""
        print(f"tcal: interrupted{hint}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
