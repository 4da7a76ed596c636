"""`tcal export`: a saved hybrid -> the Qwen3.5 dense layout, for the engines that serve it.

``--format hf`` writes a ``Qwen3_5ForCausalLM`` checkpoint (config.json, model.safetensors, generation config,
tokenizer and chat template) that transformers loads without tcal, and that vLLM and SGLang serve.
``--format gguf`` writes ``model-<type>.gguf`` of llama.cpp's architecture ``qwen35`` with the tokenizer inside.
Both reload what they wrote with that engine and compare its logits with the hybrid's before anything is
published (``--no-check`` skips it); the report (export.md, export.json) says what was compared and how each
kept attention layer's q/k norms were made.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from tcal.utils.config import OutArgs, arg
from tcal.utils.errors import TcalError

FORMATS = ("hf", "gguf")
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")  # tcal.export.gguf.FILE_TYPES, here for --help without torch


@dataclass
class ExportConfig(OutArgs):
    hybrid: str = arg("runs/convert", "a hybrid directory saved by tcal convert or tcal distill")
    out: str = arg("runs/export", "output directory (written atomically)")
    format: str = arg("hf", "hf (a Qwen3_5ForCausalLM checkpoint: transformers without tcal, vLLM, SGLang) or "
                            "gguf (llama.cpp, architecture qwen35)", choices=FORMATS)
    dtype: str = arg("float32", "hf: weight dtype, float32 or bfloat16 (1-D tensors stay float32)",
                     choices=("float32", "bfloat16"))
    gguf_type: str = arg("f16", "gguf: tensor type, f32, f16, bf16 or q8_0 (norms, gates and the scaled "
                                "attention q/k weights stay f32 where the type cannot hold them)", choices=GGUF_TYPES)
    gguf_vocab: str = arg("", "gguf: a .gguf whose tokenizer to copy (default: the teacher's own GGUF where the "
                              "teacher was one, else the hybrid's tokenizer)")
    check: bool = arg(True, "reload the export with its engine and compare its logits (and a GGUF's tokenizer) "
                            "with the hybrid's before publishing")
    progress: bool = arg(True, "progress bar while the GGUF's tensors are written")


def _teacher_spec(path: Path) -> str | None:
    try:
        return json.loads((path / "tcal_config.json").read_text()).get("teacher")
    except (OSError, ValueError, AttributeError):
        return None


def _vocab(cfg: ExportConfig, src: Path, tokenizer):
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
        return vocab.from_tokenizer(tokenizer)
    return vocab.no_vocab()


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

    from tcal.export import qwen3_5
    from tcal.utils.atomic import atomic_dir, check_out, write_json, written_files

    out = check_out(cfg.out, "export", cfg.overwrite)
    if cfg.format not in FORMATS:
        raise TcalError(f"--format must be hf or gguf, got {cfg.format!r}")
    if cfg.format == "gguf" and cfg.check:
        from tcal.export.check import llama_cpp

        llama_cpp()  # missing before any work, not after the file is written
    if cfg.format == "gguf" and cfg.gguf_vocab:
        from tcal.data.corpora import path_exists

        if not path_exists(cfg.gguf_vocab):
            raise TcalError(f"--gguf-vocab {cfg.gguf_vocab} does not exist; pass the teacher's .gguf file")
    src, hybrid, tok = _load_hybrid(cfg.hybrid)
    qwen3_5.check_layout(hybrid, cfg.format)  # what blocks the export, before anything is written
    kind = cfg.dtype if cfg.format == "hf" else cfg.gguf_type
    with atomic_dir(out) as tmp, torch.no_grad():
        if cfg.format == "hf":
            target = tmp
            layout = qwen3_5.to_qwen3_5(hybrid)
            _write_hf(tmp, src, layout.config, layout.state_dict, tok, cfg.dtype)
            types = None
        else:
            from tcal.export.gguf import export_gguf

            vocab = _vocab(cfg, src, tok)
            target = tmp / f"model-{cfg.gguf_type}.gguf"
            layout, types = export_gguf(hybrid, target, cfg.gguf_type, vocab, progress=cfg.progress,
                                        name=f"tcal hybrid of {_teacher_spec(src) or src.name}")
        record = {"hybrid": str(src), "format": cfg.format, "type": kind, "layout": qwen3_5.ARCHITECTURE,
                  "layer_types": layout.config["layer_types"], "attention_qk_norms": layout.record()}
        if types is not None:
            record.update(tensor_types=types, tokenizer=vocab.source)
        if cfg.check:
            from tcal.export.check import check_export

            res = check_export(hybrid, tok, cfg.format, target, kind)
            record["check"] = dataclasses.asdict(res)
            if not res.ok:
                why = (f"logits differ from the hybrid's by {res.rel_err:.2e} (tolerance {res.tolerance:.0e})"
                       if res.rel_err > res.tolerance else f"its tokenizer {res.tokenizer}")
                raise TcalError(f"the {cfg.format} export does not reproduce the hybrid: {why}; nothing was written "
                                "(--no-check publishes it anyway)")
        write_json(tmp / "export.json", record)
        write_json(tmp / "tcal_config.json", {"stage": "export", **dataclasses.asdict(cfg)})
        (tmp / "export.md").write_text(export_markdown(cfg, record))
    chk = record.get("check")
    print(f"wrote {cfg.out}: {cfg.format} ({kind}), {record['layer_types'].count('linear_attention')} GDN layers; "
          + (f"logits within {chk['rel_err']:.1e} of the hybrid's, same next token at {chk['top1_agree']:.0%} of "
             f"{chk['tokens']} positions" if chk else "not checked (--no-check)")
          + f"; files: {', '.join(written_files(out))}")
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
    save_file({k: (v if v.dim() == 1 else v.to(dt)).contiguous() for k, v in sd.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    if (src / "generation_config.json").is_file():
        shutil.copy2(src / "generation_config.json", tmp / "generation_config.json")
    if tok is not None:
        tok.save_pretrained(tmp)


def export_markdown(cfg: ExportConfig, record: dict) -> str:
    out = Path(cfg.out)
    lines = [f"# tcal export: {record['hybrid']} -> {record['layout']} ({cfg.format}, {record['type']})", "",
             f"- layers: {record['layer_types'].count('linear_attention')} Gated DeltaNet, "
             f"{len(record['layer_types']) - record['layer_types'].count('linear_attention')} attention"]
    for i, n in record["attention_qk_norms"].items():
        lines.append(f"- attention layer {i}: q norm {n['q_norm']}, k norm {n['k_norm']}")
    if record.get("tokenizer"):
        lines.append(f"- tokenizer: {record['tokenizer']}")
    chk = record.get("check")
    if chk:
        lines.append(f"- check: reloaded with {'transformers' if cfg.format == 'hf' else 'llama.cpp'}, logits on "
                     f"{chk['tokens']} probe tokens within {chk['rel_err']:.2e} of the hybrid's (tolerance "
                     f"{chk['tolerance']:.0e}), same next token at {chk['top1_agree']:.0%}; tokenizer: {chk['tokenizer']}")
    else:
        lines.append("- check: skipped (--no-check)")
    lines += ["", "## Serve", ""]
    if cfg.format == "hf":
        lines += ["```bash",
                  f"python -c \"import transformers as t; m = t.AutoModelForCausalLM.from_pretrained('{out}')\"",
                  f"vllm serve {out}",
                  f"python -m sglang.launch_server --model-path {out}",
                  "```"]
    else:
        lines += ["```bash", f"llama-server -m {out}/model-{cfg.gguf_type}.gguf", "```"]
    return "\n".join(lines) + "\n"
