"""`tcal export`: a saved hybrid -> the Qwen3.5 dense layout, for the engines that serve it.

``--format hf`` writes a ``Qwen3_5ForCausalLM`` checkpoint (config.json, model.safetensors, generation config,
tokenizer and chat template: the hybrid's own, else its teacher's) that transformers loads without tcal, and that
vLLM and SGLang serve where their rules allow (:mod:`tcal.engines`).
``--format gguf`` writes ``model-<type>.gguf`` of llama.cpp's architecture ``qwen35`` with the tokenizer inside.
Both reload what they wrote with that engine and compare its logits with the hybrid's before anything is
published (``--no-check`` skips it); the report (export.md, export.json) says what was compared, how each
kept attention layer's q/k norms were made, and which engines run the export exactly, with rounding, or not.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from tcal.engines import export_engines
from tcal.utils.command_config import OutArgs, arg
from tcal.utils.errors import TcalError

FORMATS = ("hf", "gguf")
# tcal.export.gguf.FILE_TYPES, here for --help without torch
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_k_m", "q4_0")
HF_DTYPES = ("float32", "bfloat16")
DEFAULT_DTYPE, DEFAULT_GGUF_TYPE = "float32", "f16"


@dataclass
class ExportConfig(OutArgs):
    hybrid: str = arg("runs/convert", "a hybrid directory saved by tcal convert or tcal distill")
    out: str = arg("runs/export", "output directory (written atomically)")
    format: str = arg("hf", "hf (a Qwen3_5ForCausalLM checkpoint: transformers without tcal, vLLM, SGLang) or "
                            "gguf (llama.cpp, architecture qwen35)", choices=FORMATS)
    dtype: str = arg("", "hf only: weight dtype, float32 (the default) or bfloat16 (1-D tensors stay float32); "
                         "not float16, which cannot hold the linearised attention q/k norms")
    gguf_type: str = arg("", "gguf only: tensor type, f32, f16 (the default), bf16, q8_0, or q4_k_m / q4_0 "
                             "(llama.cpp's quantiser on the f16 file); norms, gates and the scaled attention q/k "
                             "weights stay f32 or bf16 where the type cannot hold them", choices=GGUF_TYPES)
    gguf_vocab: str = arg("", "gguf only: a .gguf whose tokenizer to copy (default: the teacher's own GGUF where the "
                              "teacher was one, else the hybrid's tokenizer)")
    engines: str = arg("", "engines the export must run in, comma-separated: "
                           + " or ".join(f"{', '.join(e.key for e in export_engines(f))} ({f})" for f in FORMATS)
                           + "; one that cannot run this hybrid is an error before any work (default: none required; "
                           "export.md says how every engine of the format runs it)")
    check: bool = arg(True, "reload the export with its engine and compare its logits (and a GGUF's tokenizer) "
                            "with the hybrid's before publishing")
    progress: bool = arg(True, "progress bar while the GGUF's tensors are written")


def _teacher_spec(path: Path) -> str | None:
    try:
        return json.loads((path / "tcal_config.json").read_text()).get("teacher")
    except (OSError, ValueError, AttributeError):
        return None


def _vocab(cfg: ExportConfig, src: Path, tokenizer, rows: int):
    """The tokenizer keys of the GGUF: --gguf-vocab, else the teacher's own GGUF, else the hybrid's tokenizer."""
    from tcal.data.corpora import path_exists
    from tcal.data.teachers import builtin_gguf_path
    from tcal.export import vocab

    if cfg.gguf_vocab:
        return vocab.from_gguf(cfg.gguf_vocab)
    teacher = _teacher_spec(src)
    if teacher:
        from tcal.data.teacher_table import TEACHERS

        if teacher in TEACHERS:
            return vocab.from_gguf(builtin_gguf_path(teacher))
        if teacher.lower().endswith(".gguf") and path_exists(teacher):
            return vocab.from_gguf(teacher)
    if tokenizer is not None:
        return vocab.from_tokenizer(tokenizer, rows)
    return vocab.no_vocab()


def _teacher_tokenizer(spec: str):
    """The tokenizer of the teacher a hybrid records (a built-in, a directory, a .gguf or a hub id)."""
    from transformers import AutoTokenizer

    from tcal.data.corpora import path_exists
    from tcal.data.teachers import BUILTIN_TEACHERS, builtin_teacher_dir, load_tokenizer_dir

    path = Path(spec).expanduser()
    try:
        if spec in BUILTIN_TEACHERS:
            return load_tokenizer_dir(builtin_teacher_dir(spec))
        if path_exists(spec) and path.is_dir():
            return load_tokenizer_dir(path)
        if path_exists(spec) and path.suffix.lower() == ".gguf":
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return AutoTokenizer.from_pretrained(spec)
    except TcalError:
        raise
    except Exception as e:
        raise TcalError(f"the hybrid has no tokenizer files and its teacher's ({spec}) does not load ({type(e).__name__}"
                        f": {str(e).splitlines()[0] if str(e) else ''}); save the teacher's tokenizer into the hybrid's "
                        "directory (tokenizer.save_pretrained) and export again") from None


def _hf_tokenizer(src: Path, tok, rows: int):
    """(the tokenizer the hf export carries, where it came from): the hybrid's own, else its teacher's; an export
    that cannot encode text is refused."""
    if tok is None:
        teacher = _teacher_spec(src)
        if not teacher:
            raise TcalError(f"{src} has no tokenizer files and records no teacher, so the export could not encode "
                            "text; save the teacher's tokenizer into it (tokenizer.save_pretrained) and export again")
        tok, source = _teacher_tokenizer(teacher), f"the teacher's ({teacher})"
    else:
        source = "the hybrid's own tokenizer files"
    if len(tok) > rows:
        raise TcalError(f"the tokenizer ({source}) has {len(tok):,} tokens and the hybrid's embedding {rows:,} rows: "
                        "it is another model's tokenizer; save the teacher's tokenizer into the hybrid's directory")
    return tok, source


def _options(cfg: ExportConfig) -> tuple[str, str]:
    """(format, the export's type: --dtype or --gguf-type): options of the other format and dtypes no engine runs
    are one-line errors."""
    if cfg.format not in FORMATS:
        raise TcalError(f"--format must be hf or gguf, got {cfg.format!r}")
    if cfg.format == "hf":
        for flag, value in (("--gguf-type", cfg.gguf_type), ("--gguf-vocab", cfg.gguf_vocab)):
            if value:
                raise TcalError(f"{flag} is for --format gguf; an hf export's precision is --dtype (float32 or "
                                "bfloat16) and it carries the hybrid's tokenizer files (or its teacher's)")
        dtype = cfg.dtype or DEFAULT_DTYPE
        if dtype in ("float16", "fp16", "half"):
            raise TcalError("--dtype float16 cannot hold the linearised attention q/k norms (scaled weights near "
                            "1e-10 flush to zero, norm weights near 1e5 overflow), and vLLM and SGLang run what a "
                            "checkpoint's dtype says: export float32 or bfloat16")
        if dtype not in HF_DTYPES:
            raise TcalError(f"--dtype {dtype}: an hf export is float32 or bfloat16")
        return cfg.format, dtype
    if cfg.dtype:
        raise TcalError(f"--dtype is for --format hf; a GGUF's precision is --gguf-type ({', '.join(GGUF_TYPES)})")
    return cfg.format, cfg.gguf_type or DEFAULT_GGUF_TYPE


def _load_hybrid(path: str):
    from tcal.data.corpora import path_exists
    from tcal.data.teachers import load_model_dir
    from tcal.models.configuration_hybrid import HybridConfig

    src = Path(path).expanduser()
    if not path_exists(path) or not src.is_dir():
        raise TcalError(f"hybrid {path} is not a directory; pass a directory saved by tcal convert or tcal distill")
    try:
        model_type = json.loads((src / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        model_type = None
    if model_type != HybridConfig.model_type:
        raise TcalError(f"{path} holds no tcal hybrid (model_type {model_type!r}); export converts what tcal "
                        "convert or tcal distill saved")
    import torch

    model, tok = load_model_dir(src, torch.float32, require_tokenizer=False)
    return src, model.eval(), tok


def run(cfg: ExportConfig) -> Path:
    import torch

    from tcal import engines
    from tcal.export import qwen3_5
    from tcal.export.gguf import QUANTISED
    from tcal.utils.atomic import atomic_dir, check_out, write_json, written_files
    from tcal.utils.progress import say

    out = check_out(cfg.out, "export", cfg.overwrite)
    fmt, kind = _options(cfg)
    required = engines.parse_engines(cfg.engines, fmt)
    if fmt == "gguf" and (cfg.check or kind in QUANTISED):  # missing before any work, not after the file is written
        from tcal.engines.llamacpp import module
        from tcal.export.check import CHECK_NEEDS
        from tcal.export.gguf import quantiser_needed

        try:
            module()
        except TcalError:
            raise TcalError(quantiser_needed(kind) if kind in QUANTISED else CHECK_NEEDS) from None
    if fmt == "gguf" and cfg.gguf_vocab:
        from tcal.data.corpora import path_exists

        if not path_exists(cfg.gguf_vocab):
            raise TcalError(f"--gguf-vocab {cfg.gguf_vocab} does not exist; pass the teacher's .gguf file")
    src, hybrid, tok = _load_hybrid(cfg.hybrid)
    qwen3_5.check_layout(hybrid, fmt)  # what blocks the export, before anything is written
    rows = hybrid.config.vocab_size
    if fmt == "hf":
        tok, tok_source = _hf_tokenizer(src, tok, rows)
    else:
        from tcal.export.vocab import check_rows

        vocab = _vocab(cfg, src, tok, rows)
        check_rows(vocab, rows)  # another model's tokenizer, before the file is written
        tok_source = vocab.source
    layout = qwen3_5.to_qwen3_5(hybrid)
    why = engines.required_blocker(layout, fmt, kind, required)
    if why:
        raise TcalError(f"--engines {cfg.engines}: {why}")
    with atomic_dir(out) as tmp, torch.no_grad():
        if fmt == "hf":
            target = tmp
            _write_hf(tmp, src, layout.config, layout.state_dict, tok, kind)
            types = None
        else:
            from tcal.export.gguf import export_gguf

            target = tmp / f"model-{kind}.gguf"
            layout, types = export_gguf(hybrid, target, kind, vocab, progress=cfg.progress,
                                        name=f"tcal hybrid of {_teacher_spec(src) or src.name}")
        record = {"hybrid": str(src), "format": fmt, "type": kind, "layout": qwen3_5.ARCHITECTURE,
                  "layer_types": layout.config["layer_types"], "attention_qk_norms": layout.record(),
                  "tokenizer": tok_source}
        if types is not None:
            record.update(tensor_types=types)
        if cfg.check:
            from tcal.export.check import check_export

            res = check_export(hybrid, tok, fmt, target, kind)
            record["check"] = dataclasses.asdict(res)
            if not res.ok:
                why = (f"logits differ from the hybrid's by {res.rel_err:.2e} (tolerance {res.tolerance:.0e})"
                       if res.rel_err > res.tolerance else f"its tokenizer {res.tokenizer}")
                raise TcalError(f"the {fmt} export does not reproduce the hybrid: {why}; nothing was written "
                                "(--no-check publishes it anyway)")
        table = engines.engine_table(layout, fmt, kind, record.get("check"))
        record["engines"] = engines.table_record(table)
        write_json(tmp / "export.json", record)
        resolved = {"dtype": kind, "gguf_type": ""} if fmt == "hf" else {"dtype": "", "gguf_type": kind}
        write_json(tmp / "tcal_config.json", {"stage": "export", **dataclasses.asdict(cfg), **resolved})
        serve = engines.serve_commands(layout, fmt, kind, str(Path(cfg.out)))
        (tmp / "export.md").write_text(export_markdown(cfg, record, table, serve))
    chk = record.get("check")
    print(f"wrote {cfg.out}: {fmt} ({kind}), {record['layer_types'].count('linear_attention')} GDN layers; "
          + (f"logits within {chk['rel_err']:.1e} of the hybrid's, same next token at {chk['top1_agree']:.0%} of "
             f"{chk['tokens']} positions" if chk else "not checked (--no-check)")
          + f"; files: {', '.join(written_files(out))}")
    for row in table:
        if row.runs == engines.CANNOT:
            say(f"{row.engine} cannot run this export: {row.how}")
    return out


# 1-D tensors (norms, gates, biases) keep float32 in a bfloat16 checkpoint: w - 1 of a norm rounds badly in bf16
def _write_hf(tmp: Path, src: Path, config: dict, sd: dict, tok, dtype: str) -> None:
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    hf_config = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    hf_config.dtype = dtype
    hf_config.save_pretrained(tmp)
    # the keys the engines read that transformers folds away when it saves its config (rotary factor, theta)
    from tcal.export.qwen3_5 import ENGINE_KEYS

    saved = json.loads((tmp / "config.json").read_text())
    saved.update({k: config[k] for k in ENGINE_KEYS if k in config})
    (tmp / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    save_file({k: (v if v.dim() == 1 else v.to(dt)).contiguous() for k, v in sd.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    if (src / "generation_config.json").is_file():
        shutil.copy2(src / "generation_config.json", tmp / "generation_config.json")
    if tok is not None:
        tok.save_pretrained(tmp)


def export_markdown(cfg: ExportConfig, record: dict, table=(), serve=()) -> str:
    """export.md: what was written and checked, the engine table, and the commands that serve it (``serve``:
    :func:`tcal.engines.serve_commands`)."""
    fmt, kind = record["format"], record["type"]
    lines = [f"# tcal export: {record['hybrid']} -> {record['layout']} ({fmt}, {kind})", "",
             f"- layers: {record['layer_types'].count('linear_attention')} Gated DeltaNet, "
             f"{len(record['layer_types']) - record['layer_types'].count('linear_attention')} attention"]
    for i, n in record["attention_qk_norms"].items():
        lines.append(f"- attention layer {i}: q norm {n['q_norm']}, k norm {n['k_norm']}")
    if record.get("tokenizer"):
        lines.append(f"- tokenizer: {record['tokenizer']}")
    chk = record.get("check")
    if chk:
        lines.append(f"- check: reloaded with {'transformers' if fmt == 'hf' else 'llama.cpp'}, logits on "
                     f"{chk['tokens']} probe tokens within {chk['rel_err']:.2e} of the hybrid's (tolerance "
                     f"{chk['tolerance']:.0e}), same next token at {chk['top1_agree']:.0%}; tokenizer: {chk['tokenizer']}")
    else:
        lines.append("- check: skipped (--no-check)")
    if table:
        lines += ["", "## Engines", "", "| engine | versions | runs this export | how, or why not |", "|---|---|---|---|"]
        lines += [f"| {r.engine} | {r.versions} | {r.runs} | {r.how} |" for r in table]
    lines += ["", "## Serve", "", "```bash", *serve, "```"]
    return "\n".join(lines) + "\n"
