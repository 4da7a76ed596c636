"""How each engine that runs exports runs a given export: its rule (:class:`~tcal.engines.engine.EngineRow`: exactly,
with rounding and how much, or cannot and why) and the command that serves it.

The rules come from the engines' released code (vLLM 0.34.0, SGLang 0.5.23, FlashInfer 0.7; docs/serving.md cites
the files) and from what tcal's tests run (transformers, llama.cpp):

- vLLM (``Qwen3_5ForCausalLM`` from 0.27.0) builds attention q/k/v biases from the config key ``qkv_bias``, never an
  o_proj bias, and skips a checkpoint tensor it has no parameter for without a word. It serves a float32
  checkpoint in bfloat16 unless told ``--dtype float32``; ``--dtype half`` cannot hold the linearised q/k norms
  (weights near 1e-10 flush to zero, norm weights near 1e5 overflow). On Hopper it takes FlashInfer's GDN prefill
  kernel whatever the head size, and that kernel runs head size 128 only.
- SGLang (``Qwen3_5ForCausalLM`` from 0.5.17) ignores ``layer_types``: layer i is attention exactly when
  (i + 1) % full_attention_interval == 0. Its attention has no q/k/v bias (a checkpoint's are skipped), and it
  serves a float32 checkpoint in float16 unless told ``--dtype``.
- A placement, a bias or a dtype an engine cannot run is "cannot"; bfloat16 or quantised weights are "rounding",
  with the export check's own measurement of how much.
"""
from __future__ import annotations

from tcal.engines.engine import CANNOT, EXACT, ROUNDING, EngineRow, Facts
from tcal.engines.placement import interval_layers

VLLM_VERSIONS = "vLLM 0.27.0-0.34.0 (read: 0.27.0, 0.34.0)"
SGLANG_VERSIONS = "SGLang 0.5.17-0.5.23 (read: 0.5.17, 0.5.23)"
# the GDN head size FlashInfer's Hopper (SM90) prefill kernel takes (flashinfer/gdn_kernels/delta_rule_dsl/
# delta_rule_sm90.py: "DSL kernel only supports D=128")
FLASHINFER_SM90_HEAD = 128


def _rounding(check: dict | None, key: str = "") -> str:
    """The export check's measurement of a rounding, as words."""
    if not check:
        return "not measured (--no-check)"
    rel, agree = (check.get(f"{key}rel_err"), check.get(f"{key}top1_agree"))
    if rel is None:
        return "not measured"
    return f"relative logit error {rel:.1e} on the probe, same next token at {agree:.0%}"


def _sglang_placement(f: Facts) -> str | None:
    if f.interval:
        return None
    n = len(f.layer_types)
    k = min(n, max(2, round(n / max(1, len(f.attention_layers)))))  # the period nearest this attention share
    return (f"it places attention by full_attention_interval alone (layer i when (i + 1) % K == 0) and ignores "
            f"layer_types; attention at {_layers(f.attention_layers)} is no such placement (convert with --keep "
            f"interval:{k} for attention at {_layers(interval_layers(k, n))})")


def _layers(layers: list[int]) -> str:
    return ",".join(map(str, layers)) if len(layers) <= 12 else f"{','.join(map(str, layers[:10]))},... ({len(layers)})"


def vllm_row(f: Facts, check: dict | None) -> EngineRow:
    if f.o_bias:
        return EngineRow("vLLM", VLLM_VERSIONS, CANNOT, "its attention o_proj has no bias, and it skips the "
                         "checkpoint's without a word")
    how = ["bfloat16 by default (the hf check ran the export in bfloat16 in transformers: "
           f"{_rounding(check, 'bf16_')}); --dtype float32 for float32 compute (not run by tcal)"]
    if f.linearised:
        how.append("never --dtype half: float16 cannot hold the linearised q/k norms")
    how.append("GDN state in float32 (mamba_ssm_dtype)")
    if f.qkv_bias:
        how.append("q/k/v biases through qkv_bias")
    if f.gdn_head_dim != FLASHINFER_SM90_HEAD:
        how.append(f"on Hopper GPUs (H100, H200) add --gdn-prefill-backend triton: vLLM takes FlashInfer's GDN "
                   f"prefill kernel there whatever the head size, and it runs head size {FLASHINFER_SM90_HEAD} only "
                   f"(this export's is {f.gdn_head_dim})")
    return EngineRow("vLLM", VLLM_VERSIONS, ROUNDING, "; ".join(how))


def sglang_row(f: Facts, check: dict | None) -> EngineRow:
    # Biases first: they come from the teacher, so advice to re-convert with another placement would not help.
    if f.qkv_bias or f.o_bias:
        return EngineRow("SGLang", SGLANG_VERSIONS, CANNOT, "its attention has no q/k/v or o_proj bias, and it skips "
                         "the checkpoint's without a word (no keep policy changes the teacher's biases)")
    placement = _sglang_placement(f)
    if placement:
        return EngineRow("SGLang", SGLANG_VERSIONS, CANNOT, placement)
    if f.kind == "bfloat16":
        dtype = "bfloat16 (the checkpoint's dtype)"
    else:
        dtype = ("only with --dtype bfloat16 (or float32): its default for a float32 checkpoint is float16"
                 + (", which cannot hold the linearised q/k norms" if f.linearised else ""))
    return EngineRow("SGLang", SGLANG_VERSIONS, ROUNDING,
                     f"{dtype} (bfloat16 in transformers: {_rounding(check, 'bf16_')}); full_attention_interval "
                     f"{f.interval}; GDN state in float32")


def transformers_row(f: Facts, check: dict | None) -> EngineRow:
    versions = "transformers >= 5.17 (tested: the installed one)"
    if f.kind == "float32":
        return EngineRow("transformers", versions, EXACT, f"float32, no tcal needed ({_rounding(check)})")
    return EngineRow("transformers", versions, ROUNDING, f"bfloat16 weights, 1-D tensors float32 ({_rounding(check)})")


def llama_cpp_row(f: Facts, check: dict | None) -> EngineRow:
    versions = "llama.cpp qwen35 (tested: llama-cpp-python 0.3.36)"
    if f.kind in ("f32", "float32"):
        return EngineRow("llama.cpp", versions, EXACT, f"with an f32 KV cache ({_rounding(check)}); its default f16 "
                         "cache rounds every cached key and value")
    return EngineRow("llama.cpp", versions, ROUNDING, f"{f.kind} tensors ({_rounding(check)})")


def serve_transformers(out: str, f: Facts) -> str:
    return f"python -c \"import transformers as t; m = t.AutoModelForCausalLM.from_pretrained('{out}')\""


def serve_vllm(out: str, f: Facts) -> str:
    backend = " --gdn-prefill-backend triton   # on H100/H200" if f.gdn_head_dim != FLASHINFER_SM90_HEAD else ""
    return f"vllm serve {out}{backend}"


def serve_sglang(out: str, f: Facts) -> str:
    return f"python -m sglang.launch_server --model-path {out}" + (" --dtype bfloat16" if f.kind == "float32" else "")


def serve_llama_cpp(out: str, f: Facts) -> str:
    return f"llama-server -m {out}/model-{f.kind}.gguf"
