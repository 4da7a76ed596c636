"""The engines that run tcal's models, one :class:`Engine` each: its name, what it reads, how tcal checks it, what it
cannot run (its rule: which exports it runs as the hybrid, which with rounding, and how much, which not, and why) and
the command that serves an export with it. ``tcal export`` writes the table of the format's engines; ``tcal eval
--engine`` takes the engines that generate (``tcal`` itself and llama.cpp).

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

from collections.abc import Callable
from dataclasses import asdict, dataclass

from tcal.conversion.policy import interval_layers

EXACT, ROUNDING, CANNOT = "exactly", "with rounding", "cannot"
VLLM_VERSIONS = "vLLM 0.27.0-0.34.0 (read: 0.27.0, 0.34.0)"
SGLANG_VERSIONS = "SGLang 0.5.17-0.5.23 (read: 0.5.17, 0.5.23)"
# the GDN head size FlashInfer's Hopper (SM90) prefill kernel takes (flashinfer/gdn_kernels/delta_rule_dsl/
# delta_rule_sm90.py: "DSL kernel only supports D=128")
FLASHINFER_SM90_HEAD = 128


@dataclass
class Facts:
    """What the engine rules read of an export."""
    fmt: str  # hf or gguf
    kind: str  # hf: float32 / bfloat16; gguf: the file type
    layer_types: list[str]
    interval: int | None  # the period when the placement is Qwen3.5's own, else None
    qkv_bias: bool  # the kept attention layers carry q/k/v biases
    o_bias: bool  # ... and a nonzero o_proj bias
    linearised: bool  # some kept attention layer's q/k norm is the linearised one (tiny scaled weights)
    gdn_head_dim: int

    @classmethod
    def of(cls, layout, fmt: str, kind: str) -> Facts:
        cfg, sd = layout.config, layout.state_dict
        o_bias = any(k.endswith("self_attn.o_proj.bias") and bool(v.ne(0).any()) for k, v in sd.items())
        return cls(fmt, kind, list(cfg["layer_types"]), cfg.get("full_attention_interval"), bool(cfg["qkv_bias"]),
                   o_bias, bool(layout.scaled), int(cfg["linear_key_head_dim"]))

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t != "linear_attention"]


@dataclass
class EngineRow:
    engine: str  # the engine's name as people write it
    versions: str
    runs: str  # EXACT, ROUNDING or CANNOT
    how: str  # the settings it needs and the rounding, or why it cannot

    def line(self) -> str:
        return f"{self.engine} {self.runs}: {self.how}"


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


def _serve_transformers(out: str, f: Facts) -> str:
    return f"python -c \"import transformers as t; m = t.AutoModelForCausalLM.from_pretrained('{out}')\""


def _serve_vllm(out: str, f: Facts) -> str:
    backend = " --gdn-prefill-backend triton   # on H100/H200" if f.gdn_head_dim != FLASHINFER_SM90_HEAD else ""
    return f"vllm serve {out}{backend}"


def _serve_sglang(out: str, f: Facts) -> str:
    return f"python -m sglang.launch_server --model-path {out}" + (" --dtype bfloat16" if f.kind == "float32" else "")


def _serve_llama_cpp(out: str, f: Facts) -> str:
    return f"llama-server -m {out}/model-{f.kind}.gguf"


@dataclass(frozen=True)
class Engine:
    key: str  # what --engines and --engine take
    name: str  # as reports write it
    reads: str  # what it runs: "hf" or "gguf" (a tcal export of that format), or "tcal" (what tcal loads)
    checked: str  # how tcal checks that it runs what it is given
    rule: Callable[[Facts, dict | None], EngineRow] | None = None  # how it runs an export (None: not an export engine)
    serve: Callable[[str, Facts], str] | None = None  # the command that serves an export written to a directory
    generates: bool = False  # tcal eval --engine generates with it (HumanEval)


ENGINES: dict[str, Engine] = {e.key: e for e in (
    Engine("tcal", "tcal", "tcal", "the model as tcal loads it (transformers with tcal's classes): every test",
           generates=True),
    Engine("transformers", "transformers", "hf", "tcal export reloads the checkpoint in transformers and compares "
           "logits (float32 and bfloat16) and tokenisation; the tests do so in a process without tcal",
           transformers_row, _serve_transformers),
    Engine("vllm", "vLLM", "hf", "its config code run by the tests on exported config.json files; its kernels and "
           "weight loader read, not run (they need a GPU)", vllm_row, _serve_vllm),
    Engine("sglang", "SGLang", "hf", "likewise: its config code run, its kernels and weight loader read",
           sglang_row, _serve_sglang),
    Engine("llama.cpp", "llama.cpp", "gguf", "tcal export reloads the GGUF in llama.cpp (llama-cpp-python, through "
           "tcal.evaluate.llamacpp) and compares logits and tokenisation", llama_cpp_row, _serve_llama_cpp,
           generates=True),
)}
# tcal eval --engine
GENERATING = tuple(k for k, e in ENGINES.items() if e.generates)


def export_engines(fmt: str) -> list[Engine]:
    """The engines that run an export of format ``fmt``, in the order reports list them."""
    return [e for e in ENGINES.values() if e.reads == fmt and e.rule is not None]


def engine_table(layout, fmt: str, kind: str, check: dict | None = None) -> list[EngineRow]:
    """The engines of the format and how each runs the export."""
    f = Facts.of(layout, fmt, kind)
    return [e.rule(f, check) for e in export_engines(fmt)]


def serve_commands(layout, fmt: str, kind: str, out: str) -> list[str]:
    """The command of each engine that can run the export written to ``out``."""
    f = Facts.of(layout, fmt, kind)
    return [e.serve(out, f) for e in export_engines(fmt) if e.rule(f, None).runs != CANNOT]


def table_record(rows: list[EngineRow]) -> list[dict]:
    return [asdict(r) for r in rows]


def parse_engines(spec: str, fmt: str) -> list[Engine]:
    """'vllm,sglang' -> the engines; a TcalError for a name the format has no engine of."""
    from tcal.utils.errors import TcalError

    names = [s.strip().lower() for s in spec.split(",") if s.strip()]
    every = [e for e in ENGINES.values() if e.rule is not None]
    out = []
    for n in names:
        engine = ENGINES.get(n)
        if engine is None or engine.rule is None:
            raise TcalError(f"--engines {spec}: --format {fmt} is not for {n}; the engines are "
                            f"{', '.join(e.key for e in every)}")
        if engine.reads != fmt:
            raise TcalError(f"--engines {spec}: --format {fmt} is not for {n}; {n} runs --format {engine.reads}")
        out.append(engine)
    return out


def required_blocker(layout, fmt: str, kind: str, engines: list[Engine]) -> str | None:
    """The first engine of ``engines`` that cannot run the export, as one line, or None."""
    f = Facts.of(layout, fmt, kind)
    for e in engines:
        row = e.rule(f, None)
        if row.runs == CANNOT:
            return f"{row.engine} cannot run this hybrid: {row.how}"
    return None
