"""`tcal convert`: convert a teacher into a hybrid, report its held-out PPL, save it."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from tcal.conversion.inits import INITS
from tcal.conversion.policy import KEEP_HELP
from tcal.conversion.target import DEFAULT_TARGET, TARGET_HELP, TARGETS
from tcal.taylor.budget import CalibArgs
from tcal.utils.command_config import DeviceArgs, EvalArgs, GDNArgs, OutArgs, TeacherArgs, arg
from tcal.utils.errors import TcalError

SCORED_POLICIES = ("ar", "ga", "niah")  # keep policies that score layers on the calibration text


@dataclass
class ConvertConfig(TeacherArgs, CalibArgs, EvalArgs, GDNArgs, OutArgs, DeviceArgs):
    keep: str = arg("auto", KEEP_HELP + "; on a code teacher (qwen2.5-coder-*) at the reference budget (the CPU "
                            "default) auto keeps uniform:75%, the share at which its hybrid keeps its answers")
    init: str = arg("taylor", "initialisation of the GDN layers: " + ", ".join(INITS) +
                    " (docs/method.md says what each does)")
    target: str = arg(DEFAULT_TARGET, TARGET_HELP, choices=TARGETS)
    out: str = arg("runs/convert", "output directory (written atomically)")
    dtype: str = arg("float32", "weights dtype: float32 or bfloat16 (calibration's fits run in float32 either way)")
    seed: int = arg(0, "seed for the random parts of the initialisation")
    progress: bool = arg(True, "progress bars (calibration's fits)")


def run(cfg: ConvertConfig) -> Path:
    """Under ``torchrun --nproc_per_node N`` every rank converts (layer-local Phase 2 spreads its
    layers over the ranks, :mod:`tcal.taylor.parallel`) and rank 0 evaluates and writes ``cfg.out``."""
    from tcal.train import distributed as D
    from tcal.utils.runtime import resolve_device

    world = D.init_from_env(resolve_device(cfg.device))
    try:
        return _run(cfg, world)
    finally:
        D.destroy(world)


def _run(cfg: ConvertConfig, world) -> Path:
    import torch

    from tcal.conversion.convert import convert_with_record
    from tcal.conversion.inits import get_init, init_readers
    from tcal.conversion.policy import AUTO, parse_keep, parse_policy
    from tcal.conversion.resolve import apply_cpu_recipe, resolve_teacher_args
    from tcal.data.corpora import as_corpus, check_disjoint
    from tcal.data.overlap import check_no_eval_text
    from tcal.data.teacher_table import TeacherRef
    from tcal.data.teachers import load_teacher
    from tcal.data.tokens import mixture_parts
    from tcal.evaluate.plan import held_out
    from tcal.utils.atomic import atomic_dir, check_out, write_json, written_files
    from tcal.utils.flags import Reader, as_given, refuse_unread
    from tcal.utils.runtime import fit_matmul_kind, peak_memory, resolve_dtype

    # every argument is checked before the teacher loads
    given = as_given(cfg)
    if cfg.dtype.strip().lower() in ("float16", "fp16", "half"):
        raise TcalError("--dtype float16: tcal export refuses a float16 hybrid (float16 cannot hold the linearised "
                        "attention q/k norms); convert in float32 or bfloat16")
    resolve_dtype(cfg.dtype)
    keep_auto = cfg.keep.strip() == AUTO
    spec = get_init(cfg.init)
    ref = TeacherRef(cfg.teacher)
    recipe = apply_cpu_recipe(cfg, ref, given) if spec.kl and str(world.device).startswith("cpu") else None
    if recipe is not None and world.is_main():
        print(f"{cfg.teacher} on a CPU: its CPU recipe, {recipe} (flags you give win; --calib-budget NAME for a "
              "named budget as it is)", flush=True)
    resolve_teacher_args(cfg, ref, keep_budget=cfg.budget_name(world.device))
    out = check_out(cfg.out, "convert", cfg.overwrite)
    keep = parse_keep(cfg.keep)
    policy = parse_policy(keep, num_layers=None)  # the policy's syntax; its K is checked against the teacher later
    scored = policy.kind in SCORED_POLICIES
    reads_calib = spec.calibrated or scored
    evaluate = cfg.eval.lower() != "none"
    recall = cfg.recall_on(world.device)
    refuse_unread(given, [*init_readers([spec.name], recall=recall, chat=cfg.chat_kl() and not recall),
                          Reader(f"the scored keep policies ({', '.join(SCORED_POLICIES)})", ("calib",), scored),
                          Reader("--keep auto (its layers follow the budget)", ("calib_budget",), keep_auto),
                          Reader("an evaluated run (--eval not none)", ("eval_window", "eval_windows"), evaluate)],
                  f"--init {spec.name} --keep {given.keep}" + ("" if evaluate else " --eval none"))
    if spec.calibrated:
        cfg.check_calib()
        for part in mixture_parts(cfg.calib):
            as_corpus(part)
    if evaluate:
        cfg.check_eval()
        check_disjoint(cfg.calib, cfg.eval, role="calibration")
        ppl = held_out(cfg.eval_list(), cfg.eval_window, cfg.eval_windows, progress=cfg.progress)
        ppl.check()  # each domain read once, for both models
    if reads_calib:  # these read the calibration text
        check_no_eval_text(cfg.calib, [d if c is None else c for d, c in ppl.corpora.items()] if evaluate else (),
                           role="calibration data")
    device, dtype = world.device, resolve_dtype(cfg.dtype)
    budget = cfg.budget(device)
    t0 = time.perf_counter()
    teacher, tokenizer = load_teacher(cfg.teacher, dtype=dtype, device=device)
    timings = {"load_teacher_s": time.perf_counter() - t0}
    # the process's peak memory so far, after each part: where the peak of a conversion comes from
    peaks = {"after_load": peak_memory(torch.device(device))}
    t0 = time.perf_counter()
    conv = convert_with_record(
        teacher, keep, spec.name, seed=cfg.seed, calib=cfg.calib, tokenizer=tokenizer,
        calib_window=budget.window, calib_windows=budget.windows, progress=cfg.progress and world.is_main(),
        use_short_conv=cfg.use_short_conv, output_gate=cfg.output_gate, target=cfg.target, share_weights=True,
        **({"align": budget.align} if spec.calibrated else {}),
        **({"kl": budget.kl, **cfg.kl_options(budget)} if spec.kl else {}),
    )
    hybrid, record = conv.hybrid, conv.record
    timings["convert_s"] = time.perf_counter() - t0
    peaks["after_convert"] = peak_memory(torch.device(device))
    if not world.is_main():  # every rank holds the same hybrid; rank 0 evaluates and writes it
        return out
    report = {"teacher": cfg.teacher, "init": cfg.init, "target": hybrid.config.target, "layer_types": hybrid.config.layer_types,
              "timings": {**timings, **record["timings"]}, "selection": record.get("selection"),
              "warnings": record.get("warnings", []),
              "kl_stage": kl_summary(record["detail"]),
              "calibration": record.get("calibration") and {
                  **record["calibration"], "budget": budget.name, "align": dataclasses.asdict(budget.align),
                  # what the fits' fp32 products ran as: tf32, bf16 or fp32 (runtime.tf32_matmul)
                  "matmul": {**({"phase2": fit_matmul_kind(device, budget.align.tf32)}
                                if spec.phase2 else {}),
                             **({"kl": fit_matmul_kind(device, budget.kl.tf32)}
                                if spec.kl else {})},
                  **({"kl": dataclasses.asdict(budget.kl)} if spec.kl else {})}}
    if evaluate:
        from tcal.evaluate.score_cache import model_identity

        t0 = time.perf_counter()
        # the teacher never changes: its perplexity is scored once per machine and read back by every conversion
        report["eval"] = {"teacher": ppl.reports(teacher, tokenizer, kept_as=model_identity(cfg.teacher))}
        timings["teacher_ppl_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        report["eval"]["hybrid"] = ppl.reports(hybrid, tokenizer)
        timings["hybrid_ppl_s"] = time.perf_counter() - t0
        report["timings"].update({k: timings[k] for k in ("teacher_ppl_s", "hybrid_ppl_s")})
        peaks["after_eval"] = peak_memory(torch.device(device))
    report["peak_memory"] = {"kind": peaks["after_load"]["kind"],
                             **{k: round(v["bytes"] / 2**30, 3) if v["bytes"] else None for k, v in peaks.items()},
                             "unit": "GiB"}
    stats = record["detail"].get("statistics")
    with atomic_dir(out) as tmp, torch.no_grad():
        hybrid.save_pretrained(tmp, atomic=False)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_json(tmp / "tcal_config.json", {"stage": "convert", **dataclasses.asdict(cfg)})
        write_json(tmp / "report.json", report)
        (tmp / "report.md").write_text(convert_markdown(cfg, report))
        if stats is not None:
            write_json(tmp / "teacher_stats.json", stats)
    for name, by in report.get("eval", {}).items():
        print(f"{name}: held-out PPL " + ", ".join(f"{r['ppl']:.2f} on {d}" for d, r in by.items()))
    print(f"wrote {cfg.out}: {len(hybrid.config.gdn_layers)} GDN layers, attention kept at "
          f"{hybrid.config.attention_layers}; files: {', '.join(written_files(out))}")
    return out


def kl_summary(detail) -> dict | None:
    """What the KL stage did (None where the init has none): steps run, the step kept, held-out KL before and
    after and at every check ((step, KL) pairs), whether the teacher's hidden states were cached."""
    kl = detail.get("kl") if isinstance(detail, dict) else None
    if not kl:
        return None
    return {k: kl.get(k) for k in ("steps_run", "best_step", "heldout_kl_before", "heldout_kl", "heldout_curve",
                                   "teacher_cached", "wall_s", "data")}


def convert_markdown(cfg: ConvertConfig, report: dict) -> str:
    lt, target = report["layer_types"], report.get("target", cfg.target)
    lines = [f"# tcal convert: {cfg.teacher} -> hybrid ({cfg.init})", "",
             f"- layout: {target}" + (" (exports to the Qwen3.5 layout with `tcal export`)"
                                     if target == "qwen3_5" else ""),
             f"- attention kept at {[i for i, t in enumerate(lt) if t != 'linear_attention']}, "
             f"{lt.count('linear_attention')}/{len(lt)} layers converted to Gated DeltaNet"]
    lines += [f"- warning: {w}" for w in report.get("warnings", [])]
    if report.get("calibration"):
        c = report["calibration"]
        lines.append(f"- calibration data: `{c['data']}`, {c['sequences']} x {c['tokens_per_sequence']} tokens "
                     "(statistics and Phase 1 on the first three quarters; the last quarter picks Phase 2's best state)")
        kl = c.get("kl") or {}
        if kl.get("recall_frac"):
            lines.append(f"- KL stage: {kl['recall_frac']:.0%} of its windows end with a copy of an earlier "
                         f"{kl['recall_span']}-token span of themselves (recall mix)")
    ks = report.get("kl_stage")
    if ks:
        on = ks.get("data")
        text = (f"{on['train_sequences']} + {on['heldout_sequences']} held-out windows of {on['tokens_per_sequence']} "
                f"tokens of `{on['data']}` (chat-format code tasks, the KL on their {on['loss_tokens']['train']:,} "
                "answer tokens)" if on else "the calibration windows")
        lines.append(f"- KL stage: on {text}; {ks['steps_run']} steps, kept the state of step {ks['best_step']}; "
                     f"held-out KL {ks['heldout_kl_before']:.4f} -> {ks['heldout_kl']:.4f}")
    if report.get("eval"):
        lines.append(f"- evaluation data (held out, disjoint from calibration): `{cfg.eval}`, "
                     f"first {cfg.eval_windows} x {cfg.eval_window} tokens")
        domains = cfg.eval_list()
        lines += ["", "| model | " + " | ".join(f"{d} PPL" for d in domains) + " |", "|---|" + "---:|" * len(domains)]
        lines += [f"| {name} | " + " | ".join(f"{by[d]['ppl']:.2f}" for d in domains) + " |"
                  for name, by in report["eval"].items()]
        if any(r.get("cached") for r in report["eval"].get("teacher", {}).values()):
            lines += ["", "The teacher's PPL was read from tcal's cache: an earlier run on this machine scored the same "
                          "weights on the same tokens, dtype and device."]
    lines += ["", "| stage | seconds |", "|---|---:|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in report["timings"].items()]
    mem = report.get("peak_memory")
    if mem:
        lines += ["", f"Peak memory ({mem['kind']}, GiB, the most so far after each part): " + ", ".join(
            f"{k.replace('_', ' ')} {v:.2f}" for k, v in mem.items() if k.startswith("after_") and v is not None)]
    return "\n".join(lines) + "\n"
