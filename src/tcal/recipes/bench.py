"""`tcal bench`: prefill and decode speed of a hybrid against its teacher, by context length.

MODEL is a shape (``tcal.models.shapes``: a real model's public config with random weights; the
hybrid keeps ``--keep`` as attention, converted with init copy) or a saved tcal hybrid directory.
For a directory the hybrid rows and ``generate`` run the loaded hybrid, and the teacher rows a
random-weight model of the hybrid's base config: speed does not depend on weight values.

Each of ``--rows`` runs at each of ``--contexts`` (see :mod:`tcal.engines.speed` for what each row
measures); ``--batch-sizes`` adds batched decode throughput of the fast rows at ``--batch-context``
(``max``: the largest batch that fits in free GPU memory); ``--check`` compares the hybrid's
FastDecoder with the eager hybrid and an fp32 copy. The rows are one registry (:mod:`tcal.engines.rows`), each
naming the model it times and the engine that runs it. A row the model cannot run (a llama.cpp row of a
hybrid the Qwen3.5 layout cannot hold, a family FastDecoder does not support) is refused before any row
is timed; a cell that still runs out of memory or fails is recorded with its error and the others go on. Writes ``--out``: bench.json (every cell, the
settings, versions), bench.md (tables), bench.png (decode and prefill against context).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tcal.engines.rows import BENCH_ROWS, rows_help
from tcal.models.shapes import SHAPES
from tcal.utils.command_config import DeviceArgs, OutArgs, arg
from tcal.utils.errors import TcalError

ROWS = tuple(BENCH_ROWS)
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")  # tcal.export.gguf.FILE_TYPES
BATCHED_DECODE_TOKENS = 32  # timed steps per batched cell
SHAPE_KEEP = "uniform:25%"  # a shape's hybrid when --keep is not given
CHECK_STEPS = 64


@dataclass
class BenchConfig(DeviceArgs, OutArgs):
    model: str = arg("qwen2.5-1.5b", f"a shape ({', '.join(SHAPES)}: that model's config with random weights) "
                                     "or a saved tcal hybrid directory")
    keep: str | None = arg(None, f"shapes only: layers kept as attention in the hybrid, a list like 0,4,8, "
                                 f"uniform:K (K a count or a percentage) or auto; default {SHAPE_KEEP} (a saved "
                                 f"hybrid keeps its own)")
    contexts: str = arg("2048,8192,32768", "prompt lengths in tokens, comma-separated")
    rows: str = arg("teacher-eager,hybrid-eager,teacher-fast,hybrid-fast", rows_help())
    decode_tokens: int = arg(128, "greedy decode steps timed after each prefill (generate: new tokens)")
    reps: int = arg(3, "timed runs per cell after one warm-up; the median is reported")
    batch_sizes: str = arg("", "batched decode throughput of the fast rows at --batch-context: comma list of "
                               "batch sizes; max = the largest batch that fits in free GPU memory (CUDA)")
    batch_context: int = arg(32768, "batched decode: tokens already in every sequence's cache")
    check: bool = arg(False, f"also compare the hybrid's FastDecoder with the eager hybrid and an fp32 copy at "
                             f"the first context ({CHECK_STEPS} teacher-forced decode steps)")
    dtype: str = arg("bfloat16", "bfloat16, float16 or float32")
    gguf_type: str = arg("f16", "llama.cpp rows: the GGUF's tensor type, f32, f16, bf16 or q8_0", choices=GGUF_TYPES)
    threads: int = arg(0, "llama.cpp rows: CPU threads (0: every core)")
    num_layers: int = arg(0, "shapes only: override the depth (0: the shape's own; e.g. 2 for a smoke run)")
    cudnn_sdpa: bool = arg(False, "allow PyTorch's cuDNN SDPA backend (off by default: on some torch + GPU "
                                  "versions it rebuilds a cuDNN graph at every decode step, which swamps decode)")
    out: str = arg("runs/bench", "output directory (written atomically): bench.json, bench.md, bench.png")
    progress: bool = arg(True, "progress bar over the cells")


@dataclass
class Plan:
    """The checked settings: everything is validated before a model is built."""

    rows: list[str]
    contexts: list[int]
    batch_sizes: list  # ints and "max"
    shape: str | None  # a shape name, or None for a saved hybrid directory
    device: str
    keep: str | None = None  # a shape's keep spec; None for a saved hybrid (it keeps its own layers)


def _ints(spec: str, flag: str, example: str, allow=()) -> list:
    out = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if part in allow:
            out.append(part)
            continue
        try:
            out.append(int(part))
        except ValueError:
            raise TcalError(f"{flag} must be whole numbers like {example}, got {part!r}") from None
    return out


def _model_config(cfg: BenchConfig) -> tuple[str | None, dict]:
    """(shape name or None, the model's config values) for --model, or a one-line error."""
    import json
    from pathlib import Path

    if cfg.model in SHAPES:
        return cfg.model, SHAPES[cfg.model]
    path = Path(cfg.model).expanduser()
    if not path.is_dir():
        raise TcalError(f"--model {cfg.model!r} is neither a shape ({', '.join(SHAPES)}) nor a directory; pass a "
                        "shape or a saved tcal hybrid directory")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        raise TcalError(f"{cfg.model} is not a saved tcal hybrid (no readable config.json); pass a directory "
                        f"written by tcal convert or tcal distill, or a shape ({', '.join(SHAPES)})") from None
    if not isinstance(config, dict) or config.get("model_type") != "tcal_hybrid":
        kind = config.get("model_type") if isinstance(config, dict) else None
        raise TcalError(f"{cfg.model} is not a saved tcal hybrid (config.json model_type {kind!r}, not "
                        f"'tcal_hybrid'); pass a directory written by tcal convert or tcal distill, or a shape "
                        f"({', '.join(SHAPES)})")
    if cfg.num_layers:
        raise TcalError(f"--num-layers changes a shape's depth; a saved hybrid ({cfg.model}) keeps its own: "
                        "drop --num-layers")
    return None, {**(config.get("base_config") or {}), **config}


def plan(cfg: BenchConfig) -> Plan:
    from tcal.conversion.policy import parse_policy, resolve_auto
    from tcal.utils.runtime import resolve_device, resolve_dtype

    rows = list(dict.fromkeys(r.strip() for r in cfg.rows.split(",") if r.strip()))
    bad = [r for r in rows if r not in ROWS]
    if bad:
        raise TcalError(f"unknown row {bad[0]!r} in --rows; choose from {', '.join(ROWS)}")
    contexts = _ints(cfg.contexts, "--contexts", "2048,8192")
    if not contexts:
        raise TcalError("--contexts is empty; give prompt lengths in tokens, e.g. 2048,8192")
    if min(contexts) < 1:
        raise TcalError(f"--contexts must be at least 1 token, got {min(contexts)}")
    batch_sizes = _ints(cfg.batch_sizes, "--batch-sizes", "1,8,32 or max", allow=("max",))
    if any(b != "max" and b < 1 for b in batch_sizes):
        raise TcalError(f"--batch-sizes must be at least 1, got {min(b for b in batch_sizes if b != 'max')}")
    if batch_sizes and not any(BENCH_ROWS[r].batched for r in rows):
        raise TcalError(f"--batch-sizes measures the fast rows: add "
                        f"{' or '.join(n for n, r in BENCH_ROWS.items() if r.batched)} to --rows")
    if not rows and not cfg.check:
        raise TcalError(f"--rows is empty and --check is off: nothing to measure; choose rows from {', '.join(ROWS)}")
    for flag, n in (("--decode-tokens", cfg.decode_tokens), ("--reps", cfg.reps),
                    ("--batch-context", cfg.batch_context)):
        if n < 1:
            raise TcalError(f"{flag} must be at least 1, got {n}")
    if cfg.num_layers < 0:
        raise TcalError(f"--num-layers must be 0 (the shape's depth) or more, got {cfg.num_layers}")
    resolve_dtype(cfg.dtype)
    from tcal.engines import get

    for row in rows:  # every engine a row needs is installed, before any work
        get(BENCH_ROWS[row].engine).runner.require(f"row {row} of tcal bench")
    if cfg.threads < 0:
        raise TcalError(f"--threads must be 0 (every core) or more, got {cfg.threads}")
    device = resolve_device(cfg.device)
    on_cuda = device.startswith("cuda")
    if "max" in batch_sizes and not on_cuda:
        raise TcalError("--batch-sizes max searches free GPU memory: it needs CUDA (--device cuda)")
    for row in (r for r in rows if BENCH_ROWS[r].cuda and not on_cuda):
        raise TcalError(f"row {row} ({BENCH_ROWS[row].how}) needs CUDA; drop it from --rows on CPU")
    shape, values = _model_config(cfg)
    limit = values.get("max_position_embeddings")
    longest = max(contexts + ([cfg.batch_context] if batch_sizes else []))
    # llama.cpp runs past the trained positions (with a warning); a speed row does not read what the model says there
    if limit and longest > limit and any(BENCH_ROWS[r].reads == "tcal" for r in rows):
        flag = "--batch-context" if longest not in contexts else "--contexts"
        raise TcalError(f"{flag} {longest} is beyond {cfg.model}'s max_position_embeddings {limit}; use "
                        f"contexts up to {limit}")
    keep = None
    if shape is None and cfg.keep is not None:
        kept = [i for i, t in enumerate(values.get("layer_types") or []) if t != "linear_attention"]
        raise TcalError(f"--keep picks a shape's attention layers; the saved hybrid {cfg.model} keeps its own "
                        f"(attention at {kept}): drop --keep (tcal convert --keep makes a hybrid with other layers)")
    if shape is not None:
        keep = SHAPE_KEEP if cfg.keep is None else cfg.keep
        layers = cfg.num_layers or values["num_hidden_layers"]
        pol = parse_policy(resolve_auto(keep, values.get("layer_types")), layers)
        if pol.kind not in ("list", "uniform"):
            raise TcalError(f"--keep {keep}: a shape has random weights, so layers cannot be scored on text; "
                            "use a list like 0,4,8 or uniform:K")
        out_of_range = [i for i in (pol.layers or []) if not 0 <= i < layers]
        if out_of_range:
            raise TcalError(f"--keep layer {out_of_range[0]} does not exist: {cfg.model} has {layers} layers "
                            f"(0-{layers - 1})")
    checked = [r for r in rows if BENCH_ROWS[r].reads != "tcal" or BENCH_ROWS[r].fast_decoder]
    base = _teacher_config(cfg, shape) if checked else None
    for row in checked:  # every row runs, or none is timed
        why = row_blocker(row, base, saved=shape is None)
        if why:
            raise TcalError(f"row {row} cannot run {cfg.model}: {why}; drop {row} from --rows")
    return Plan(rows, contexts, batch_sizes, shape, device, keep)


def _teacher_config(cfg: BenchConfig, shape: str | None):
    """The transformers config of the teacher: the shape's, or the saved hybrid's base config."""
    from transformers import AutoConfig

    from tcal.models.shapes import shape_config

    if shape is not None:
        return shape_config(shape, num_layers=cfg.num_layers)
    return AutoConfig.from_pretrained(cfg.model).teacher_config()


def row_blocker(row: str, base, *, saved: bool) -> str | None:
    """Why ``row`` cannot run on a model whose teacher config is ``base`` (one line), or None, as far as the config
    tells; ``saved``: a saved hybrid (its eps is its own), else a shape (converted here for the layout it fits).
    The weights of a saved hybrid are checked for the llama.cpp layout once loaded (:func:`check_rows_on_weights`)."""
    from tcal import families
    from tcal.conversion.target import LAYOUT_EPS, layout_blocker
    from tcal.export.gguf import ARCH, teacher_gguf_blocker
    from tcal.models.fast import runs

    spec = BENCH_ROWS[row]
    if spec.reads == "tcal":
        return runs(base) if spec.fast_decoder else None
    if spec.model == "teacher":  # the teacher as a GGUF of its family's architecture
        return teacher_gguf_blocker(base)
    why = layout_blocker(base)
    if why:
        return (f"{why}; llama.cpp runs a tcal hybrid only in that layout, and this one runs where tcal is "
                "imported (the eager, fast and generate rows)")
    why = families.of(base).gguf_rope_blocker(base, ARCH)
    if why:
        return why
    if saved and base.rms_norm_eps != LAYOUT_EPS:
        return (f"the hybrid's RMSNorm eps is {base.rms_norm_eps:g}; llama.cpp would l2-normalise its GDN q and k "
                f"with it where the hybrid uses {LAYOUT_EPS:g} (convert with --target qwen3_5)")
    return None


def check_rows_on_weights(p: Plan, hybrid) -> None:
    """What the config cannot tell: whether the loaded hybrid's weights fit the layout its exported rows need
    (a native hybrid's GDN biases or q/k norms), checked before any row is timed."""
    from tcal.export.qwen3_5 import check_layout

    for row in p.rows:
        spec = BENCH_ROWS[row]
        if spec.model != "hybrid" or spec.reads == "tcal" or hybrid is None:
            continue
        try:
            check_layout(hybrid, spec.reads)
        except TcalError as e:
            raise TcalError(f"row {row} cannot run this hybrid: {e}, or drop {row} from --rows") from None


def build_models(cfg: BenchConfig, p: Plan) -> tuple:
    """(teacher or None, hybrid or None, what the report says about them). A model no row needs is not
    kept, but its weight bytes are (the weight-read floor)."""
    import torch
    from transformers import AutoConfig

    from tcal.conversion.convert import convert
    from tcal.conversion.select import select_layers
    from tcal.data.teachers import load_model_dir
    from tcal.engines.speed import weight_bytes
    from tcal.models.shapes import model_from_config, random_model
    from tcal.utils.runtime import resolve_dtype

    dtype = resolve_dtype(cfg.dtype)
    need_teacher = any(BENCH_ROWS[r].model == "teacher" for r in p.rows)
    need_hybrid = cfg.check or any(BENCH_ROWS[r].model == "hybrid" for r in p.rows)
    if p.shape is not None:
        teacher = random_model(p.shape, dtype=dtype, device=p.device, attn_implementation="sdpa",
                               num_layers=cfg.num_layers)
        keep = select_layers(teacher, p.keep, progress=False).layers
        hybrid = convert(teacher, keep=keep, init="copy").eval() if need_hybrid else None
        about = {"kind": "shape", "name": p.shape, "family": teacher.config.model_type,
                 "num_layers": teacher.config.num_hidden_layers, "attention_layers": keep,
                 "weights": "random (speed does not depend on weight values); the hybrid converted from the "
                            "teacher with init copy",
                 "weight_bytes": {name: weight_bytes(m) for name, m in (("teacher", teacher), ("hybrid", hybrid))
                                  if m is not None}}
        if not need_teacher:
            del teacher
            teacher = None
    else:
        config = AutoConfig.from_pretrained(cfg.model)
        base = config.teacher_config()
        hybrid = None
        if need_hybrid:
            hybrid, _ = load_model_dir(cfg.model, dtype, require_tokenizer=False)
            hybrid = hybrid.to(p.device).eval()
        teacher = model_from_config(base, dtype=dtype, device=p.device, attn_implementation="sdpa") \
            if need_teacher else None
        about = {"kind": "hybrid", "name": cfg.model, "family": base.model_type,
                 "num_layers": config.num_hidden_layers, "attention_layers": config.attention_layers,
                 "weights": "hybrid rows and generate: the saved hybrid's weights; teacher rows: random weights at "
                            "the hybrid's base (teacher) config (speed does not depend on weight values)",
                 "weight_bytes": {name: weight_bytes(m) for name, m in (("teacher", teacher), ("hybrid", hybrid))
                                  if m is not None}}
    if p.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return teacher, hybrid, about


def run(cfg: BenchConfig) -> dict:
    import torch
    from tqdm.auto import tqdm

    from tcal.engines import get, speed
    from tcal.report.plots import plot_bench
    from tcal.utils.atomic import atomic_dir, check_out, write_json, written_files
    from tcal.utils.progress import say

    p = plan(cfg)
    out = check_out(cfg.out, "bench", cfg.overwrite)
    cudnn_before = torch.backends.cuda.cudnn_sdp_enabled()
    if p.device.startswith("cuda") and not cfg.cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)  # flash / memory-efficient SDPA for teacher and hybrid alike
    try:
        teacher, hybrid, about = build_models(cfg, p)
        check_rows_on_weights(p, hybrid)
        settings = {"model": cfg.model, "keep": p.keep, "contexts": p.contexts,
                    "rows": p.rows, "decode_tokens": cfg.decode_tokens, "reps": cfg.reps,
                    "batch_sizes": p.batch_sizes, "batch_context": cfg.batch_context, "check": cfg.check,
                    "dtype": cfg.dtype, "gguf_type": cfg.gguf_type, "threads": cfg.threads,
                    "num_layers": cfg.num_layers, "cudnn_sdpa": cfg.cudnn_sdpa,
                    "device": p.device}
        result = {"settings": settings, "environment": speed.environment(p.device), "model": about, "rows": [],
                  "batched": [], "check": None, "weight_read_floor": _floors(speed, about.pop("weight_bytes"))}
        max_cache = max(p.contexts) + cfg.decode_tokens + 16  # one StaticCache size: one compile for every context
        cells = [(name, ctx) for ctx in p.contexts for name in p.rows if get(BENCH_ROWS[name].engine).uses_model]
        exported = [r for r in p.rows if not get(BENCH_ROWS[r].engine).uses_model]
        batched = [(name, b) for b in p.batch_sizes for name in p.rows if BENCH_ROWS[name].batched]
        models = {"teacher": teacher, "hybrid": hybrid}
        bar = tqdm(total=len(cells) + len(batched) + len(exported) + int(cfg.check), desc="bench", unit="cell",
                   disable=not cfg.progress)
        try:
            if cfg.check:
                bar.set_postfix_str(f"check @ {p.contexts[0]}")
                try:
                    result["check"] = speed.check(hybrid, p.contexts[0], CHECK_STEPS, progress=lambda name, r: say(
                        f"check {name}: argmax agreement with fp32 {r['argmax_agree_with_fp32']}"))
                except Exception as e:  # torch.OutOfMemoryError included: the speed rows still run
                    result["check"] = {"context": p.contexts[0], "steps": CHECK_STEPS, "error": speed.error_line(e)}
                    say(f"check @ {p.contexts[0]} tokens: {result['check']['error']}")
                bar.update()
            for name, ctx in cells:  # the rows of the engines that run the loaded model, through their runners
                bar.set_postfix_str(f"{name} @ {ctx}")
                model = models[BENCH_ROWS[name].model]
                rows = get(BENCH_ROWS[name].engine).runner.bench(
                    name, model, [ctx], decode_tokens=cfg.decode_tokens, reps=cfg.reps,
                    vocab_size=model.config.vocab_size, threads=cfg.threads or None, device=p.device,
                    cache_len=max_cache)
                for row in rows:
                    if "error" in row:
                        say(f"{name} @ {ctx} tokens: {row['error']}")
                result["rows"] += rows
                bar.update()
            for name, b in batched:
                bar.set_postfix_str(f"{name} B={b} @ {cfg.batch_context}")
                model = models[BENCH_ROWS[name].model]
                row = speed.batched_row(name, model, cfg.batch_context, b, BATCHED_DECODE_TOKENS)
                if "error" in row:
                    say(f"{name} batch {b} @ {cfg.batch_context} tokens: {row['error']}")
                result["batched"].append(row)
                bar.update()
            for name in exported:
                bar.set_postfix_str(f"{name} @ {', '.join(map(str, p.contexts))}")
                rows = _export_rows(cfg, p, name, models[BENCH_ROWS[name].model])
                for row in rows:
                    if "error" in row:
                        say(f"{name} @ {row['context']} tokens: {row['error']}")
                result["rows"] += rows
                bar.update()
        finally:
            bar.close()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn_before)
    table = bench_markdown(result)
    with atomic_dir(out) as tmp:
        write_json(tmp / "bench.json", result)
        (tmp / "bench.md").write_text(table)
        plot_bench(result["rows"], tmp / "bench.png", title=_title(result))
        write_json(tmp / "tcal_config.json", {"stage": "bench", **dataclasses.asdict(cfg)})
    print(summary(result))
    print(f"wrote {cfg.out}: {', '.join(written_files(out))}")
    return result


def _export_rows(cfg: BenchConfig, p: Plan, name: str, model) -> list[dict]:
    """``model`` written to a GGUF of --gguf-type in a temporary directory (a teacher in llama.cpp's architecture for
    its family, a hybrid in the Qwen3.5 layout) and timed by the row's engine at every context (on the GPU where it
    can and --device is cuda); one error row per context if it fails."""
    import tempfile
    from pathlib import Path

    from tcal.engines import get, speed
    from tcal.export.gguf import export_gguf, write_teacher_gguf

    spec = BENCH_ROWS[name]
    try:
        with tempfile.TemporaryDirectory(prefix="tcal-bench-") as tmp:
            path = Path(tmp) / f"{name}.{spec.reads}"
            if spec.model == "teacher":
                write_teacher_gguf(model, path, cfg.gguf_type)
            else:
                export_gguf(model, path, cfg.gguf_type)
            return get(spec.engine).runner.bench(name, path, p.contexts, decode_tokens=cfg.decode_tokens,
                                                 reps=cfg.reps, vocab_size=model.config.vocab_size,
                                                 threads=cfg.threads or None, device=p.device)
    except Exception as e:  # TcalError (a hybrid the layout cannot hold) included: the other rows stand
        return [{"model": name, "context": c, "error": speed.error_line(e)} for c in p.contexts]


def _floors(speed, weight_bytes: dict) -> dict:
    floor = {"bandwidth_tb_s": speed.PEAK_BANDWIDTH / 1e12,
             "assumption": "peak HBM bandwidth of an H200-class GPU, not measured: every weight read once per "
                           "decode step at batch 1"}
    for name, n in weight_bytes.items():
        floor[f"{name}_weight_gb"] = n / 2**30
        floor[f"{name}_ms"] = n / speed.PEAK_BANDWIDTH * 1e3
    return floor


# -- the report ---------------------------------------------------------------------------------------

def _title(result) -> str:
    m, s = result["model"], result["settings"]
    return (f"{m['name']} ({s['dtype']}, {result['environment']['device']}): attention at "
            f"{len(m['attention_layers'])}/{m['num_layers']} layers")


def _ctx(n: int) -> str:
    from tcal.report.plots import context_label

    return context_label(n)


def _grid(result, key: str, fmt) -> list[str]:
    """A row x context table of ``key``: "-" where the row has no such number, "error" where it failed."""
    contexts = result["settings"]["contexts"]
    cells = {(r["model"], r["context"]): r for r in result["rows"]}

    def shown(name):
        return name != "generate" and any(key in cells.get((name, c), {}) or "error" in cells.get((name, c), {})
                                          for c in contexts)

    names = [n for n in result["settings"]["rows"] if shown(n)]
    if not names:
        return []
    lines = ["| row | " + " | ".join(_ctx(c) for c in contexts) + " |", "|---|" + "---:|" * len(contexts)]
    for n in names:
        vals = []
        for c in contexts:
            r = cells.get((n, c), {})
            vals.append("error" if "error" in r else fmt(r[key]) if r.get(key) is not None else "-")
        lines.append(f"| {n} | " + " | ".join(vals) + " |")
    return lines


def bench_markdown(result) -> str:
    m, s, env, floor = result["model"], result["settings"], result["environment"], result["weight_read_floor"]
    lines = [f"# Speed: {m['name']}", "",
             f"- {m['family']}, {m['num_layers']} layers; the hybrid keeps attention at {m['attention_layers']} "
             f"({len(m['attention_layers'])}/{m['num_layers']}), Gated DeltaNet elsewhere",
             f"- weights: {m['weights']}",
             f"- {s['dtype']} on {env['device']}; torch {env['torch']}, transformers {env['transformers']}"
             + (f", CUDA {env['cuda']}" if env.get("cuda") else "")
             + f"; cuDNN SDPA {'on' if s['cudnn_sdpa'] else 'off'}",
             f"- batch 1, random prompts; prefill: the median of {s['reps']} run{'s' * (s['reps'] != 1)} after a "
             f"warm-up; decode: {s['decode_tokens']} greedy steps after the prefill", ""]
    sections = [("Decode (ms / token)", "decode_ms", lambda x: f"{x:.2f}", ""),
                ("Prefill (tokens / s)", "prefill_tok_s", lambda x: f"{x:,.0f}", ""),
                ("Cache size (MB)", "cache_mb", lambda x: f"{x:,.1f}",
                 "Eager rows: the DynamicCache after the prefill. Fast rows: the static cache, allocated for the "
                 "prefill and every decode token.")]
    for title, key, fmt, note in sections:
        grid = _grid(result, key, fmt)
        if grid:
            lines += [f"## {title}", "", *([note, ""] if note else []), *grid, ""]
    lines += _llama_cpp_section(result)
    gen = [r for r in result["rows"] if r["model"] == "generate"]
    if gen:
        lines += ["## End-to-end generation (hybrid)", "",
                  f"HF `model.generate(max_new_tokens={s['decode_tokens']}, do_sample=False)` against "
                  "`FastDecoder.generate`, prefill included, each after a warm-up run.", "",
                  "| context | HF generate (tokens / s) | FastDecoder (tokens / s) | speed-up | same tokens |",
                  "|---:|---:|---:|---:|---|"]
        for r in gen:
            if "error" in r:
                lines.append(f"| {_ctx(r['context'])} | error | error | - | - |")
            else:
                same = "yes" if r["same_tokens"] else f"no (first differs at {r['first_diff']})"
                lines.append(f"| {_ctx(r['context'])} | {r['hf_tok_s']:,.1f} | {r['fast_tok_s']:,.1f} | "
                             f"{r['speedup']:.2f}x | {same} |")
        lines.append("")
    if result["batched"]:
        lines += [f"## Batched decode at {_ctx(s['batch_context'])} tokens", "",
                  "Cache filled with random contents instead of a batched prefill (a step's cost does not depend "
                  "on them); tokens / s = batch / step time. `max`: the largest batch that fitted in free GPU "
                  "memory.", "",
                  "| row | batch | step (ms) | tokens / s | cache (GB) |", "|---|---:|---:|---:|---:|"]
        for r in result["batched"]:
            if r.get("requested") == "max":
                b = f"max = {r['batch']}" if r.get("batch") else "max"
            else:
                b = str(r["batch"])
            if "error" in r:
                lines.append(f"| {r['model']} | {b} | error | - | - |")
            else:
                lines.append(f"| {r['model']} | {b} | {r['step_ms']:.2f} | {r['decode_tok_s']:,.0f} | "
                             f"{r['cache_gb']:.2f} |")
        lines.append("")
    floors = [(n, floor[f"{n}_weight_gb"], floor[f"{n}_ms"]) for n in ("teacher", "hybrid") if f"{n}_ms" in floor]
    if floors:
        lines += ["## Weight-read floor", "",
                  f"Weight bytes / {floor['bandwidth_tb_s']} TB/s: an assumption of peak bandwidth (H200-class HBM), "
                  "not a measurement; no batch-1 decode step can be faster than reading every weight once.", "",
                  "| model | weights (GB) | floor (ms / token) |", "|---|---:|---:|"]
        lines += [f"| {n} | {gb:.2f} | {ms:.2f} |" for n, gb, ms in floors]
        lines.append("")
    c = result["check"]
    if c:
        lines += [f"## Check: hybrid FastDecoder vs eager at {_ctx(c['context'])} ({c['steps']} decode steps)", ""]
        if "error" in c:
            lines += [f"Failed: {c['error']}", ""]
        else:
            lines += ["Relative logit error against an fp32 copy of the model run eagerly on the same tokens.", "",
                      "| path | prefill | decode median | decode max | argmax agreement | free-running first diff |",
                      "|---|---:|---:|---:|---:|---|"]
            for name, r in c.items():
                if isinstance(r, dict) and "prefill_vs_fp32" in r:
                    diff = r.get("free_running_first_diff_vs_eager", "-")
                    name = f"eager {s['dtype']}" if name == "eager_bf16" else f"FastDecoder {name}"
                    lines.append(f"| {name} | {r['prefill_vs_fp32']:.2e} | {r['decode_vs_fp32_median']:.2e} | "
                                 f"{r['decode_vs_fp32_max']:.2e} | {r['argmax_agree_with_fp32']} | "
                                 f"{'none' if diff is None else diff} |")
            lines.append("")
    errors = [r for r in result["rows"] + result["batched"] if "error" in r]
    if errors:
        lines += ["## Errors", ""]
        lines += [f"- {r['model']} @ {_ctx(r['context'])}" + (f", batch {r['batch']}" if "batch" in r else "")
                  + f": {r['error']}" for r in errors]
        lines.append("")
    return "\n".join(lines)


def _llama_cpp_section(result) -> list[str]:
    """The hybrid's llama.cpp decode and prefill against the teacher's, beside the KV-cache bound."""
    from tcal.engines.llamacpp_speed import flat_part, kv_bound
    from tcal.engines.rows import rows_of

    pair = {BENCH_ROWS[n].model: n for n in rows_of("llama.cpp")}
    by = {(r["model"], r["context"]): r for r in result["rows"] if r["model"] in pair.values() and "error" not in r}
    contexts = [c for c in result["settings"]["contexts"]
                if (pair["teacher"], c) in by and (pair["hybrid"], c) in by]
    if not contexts:
        return []
    m, s = result["model"], result["settings"]
    share = len(m["attention_layers"]) / m["num_layers"]
    teacher = {c: by[(pair["teacher"], c)] for c in contexts}
    hybrid = {c: by[(pair["hybrid"], c)] for c in contexts}
    t = {c: teacher[c]["decode_ms"] for c in contexts}
    h = {c: hybrid[c]["decode_ms"] for c in contexts}
    bound, flat = kv_bound(t, share), flat_part(h, t, share)
    first = hybrid[contexts[0]]
    where = "GPU (every layer offloaded)" if first["gpu_layers"] else f"CPU, {first['threads']} threads"
    lines = ["## llama.cpp: hybrid against teacher", "",
             f"{s['gguf_type']} GGUFs of the same weights, the teacher in llama.cpp's architecture for its family and "
             f"the hybrid in the Qwen3.5 layout (qwen35), run by llama.cpp on the {where}, f16 KV cache, batch 1; "
             f"medians of {s['reps']} pass(es). "
             f"KV bound: the teacher's step at {_ctx(contexts[0])} stands for what does not grow with the context, "
             f"and the hybrid reads {share:.0%} of the rest (the share of layers it keeps as attention). Flat part: "
             "the hybrid's step minus that share of the teacher's growth, i.e. its GDN layers, MLPs and weights; it "
             "stays constant where the GDN step does not grow with the context.", "",
             "| context | teacher decode (ms) | hybrid decode (ms) | speed-up | KV bound | hybrid flat part (ms) | "
             "teacher prefill (tok/s) | hybrid prefill (tok/s) |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in contexts:
        lines.append(f"| {_ctx(c)} | {t[c]:.2f} | {h[c]:.2f} | {t[c] / h[c]:.2f}x | {bound[c]:.2f}x | {flat[c]:.2f} | "
                     f"{teacher[c]['prefill_tok_s']:,.0f} | {hybrid[c]['prefill_tok_s']:,.0f} |")
    return lines + [""]


def summary(result) -> str:
    """The printed summary: the decode and prefill tables, the generate and batched lines."""
    lines = [_title(result)]
    for title, key, fmt in (("decode ms/token", "decode_ms", lambda x: f"{x:.2f}"),
                            ("prefill tokens/s", "prefill_tok_s", lambda x: f"{x:,.0f}")):
        grid = _grid(result, key, fmt)
        if grid:
            lines += [f"{title}:", *(g for g in grid if not g.startswith("|---"))]
    for r in result["rows"]:
        if r["model"] == "generate" and "error" not in r:
            lines.append(f"generate @ {r['context']}: HF {r['hf_tok_s']:,.1f} tok/s, FastDecoder "
                         f"{r['fast_tok_s']:,.1f} tok/s ({r['speedup']:.2f}x)")
    for r in result["batched"]:
        if "error" not in r:
            lines.append(f"batched {r['model']} B={r['batch']} @ {r['context']}: {r['decode_tok_s']:,.0f} tok/s, "
                         f"cache {r['cache_gb']:.2f} GB")
    return "\n".join(lines)

