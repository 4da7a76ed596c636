"""A Qwen3.5-layout model as a llama.cpp GGUF of architecture ``qwen35``, written with the ``gguf`` package.

Input: the layout's config and state dict (:mod:`tcal.export.qwen3_5`, transformers' names, zero-centred
norms). Output: llama.cpp's names and conventions, as its ``qwen35`` loader reads them: norm weights stored
whole (w, not w - 1) except the GDN's gated norm, which is w already; ``ssm_a`` = -exp(A_log); the conv
filter as (channels, width); the per-layer ``attention.recurrent_layers`` array, plus
``full_attention_interval`` when the placement is Qwen's periodic one.

Tensor types (``FILE_TYPES``): 1-D tensors, the conv filter and the small gate projections (``ssm_alpha``,
``ssm_beta``) stay f32; the attention q/k weights that carry a linearised norm's power-of-two scale are bf16 in
f16 and quantised files (fp16 and the quantised types' f16 block scales flush them to zero; bf16 holds 2^-k W as
exactly as W); everything else takes the file's type (q8_0 where a row is a whole number of 32-value blocks, f16
otherwise). The 4-bit types (``QUANTISED``) are llama.cpp's own quantiser applied to the f16 file, with those
tensors kept as they are and llama.cpp's mix for the rest (q4_k_m: some tensors at 6 bits; a type whose block
does not divide a row falls back to one that does).
"""
from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import numpy as np
import torch

from tcal import families
from tcal.engines.llamacpp import quiet as quiet_llama_cpp
from tcal.engines.placement import periodic_interval
from tcal.export.qwen3_5 import LLAMA_CPP_ARCH as ARCH
from tcal.export.qwen3_5 import check_layout, to_qwen3_5
from tcal.export.vocab import GGUFVocab, check_rows
from tcal.families.family import GGUF_TOP_NAMES
from tcal.families.rope import PLAIN_ROPE, GGUFRope, rope_parameters
from tcal.utils.errors import TcalError

# 4-bit types: llama.cpp's llama_ftype of each (llama.h), made by its quantiser from the f16 file
QUANTISED = {"q4_0": 2, "q4_k_m": 15}
FILE_TYPES = ("f32", "f16", "bf16", "q8_0", *QUANTISED)

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
}
_ZERO_CENTRED = ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight",
                 "output_norm.weight")
_KEEP_F32 = ("ssm_conv1d.weight", "ssm_alpha.weight", "ssm_beta.weight")


def gguf_name(name: str) -> str:
    """transformers' tensor name in the layout -> llama.cpp's."""
    if name in GGUF_TOP_NAMES:
        return GGUF_TOP_NAMES[name]
    parts = name.split(".", 3)
    if parts[:2] == ["model", "layers"] and len(parts) == 4 and parts[3] in _LAYER_NAMES:
        return f"blk.{parts[2]}.{_LAYER_NAMES[parts[3]]}"
    raise TcalError(f"{name}: llama.cpp's qwen35 has no tensor for it; export --format hf instead")


def _tensor_type(gname: str, t: torch.Tensor, file_type: str, scaled: bool):
    import gguf

    Q = gguf.GGMLQuantizationType
    if t.dim() == 1 or gname.endswith(_KEEP_F32) or file_type == "f32":
        return Q.F32
    if scaled:  # bf16 has f32's exponent range: it holds 2^-k W as exactly as it holds W
        return Q.BF16
    if file_type == "q8_0":
        return Q.Q8_0 if t.shape[-1] % 32 == 0 else Q.F16
    return {"f16": Q.F16, "bf16": Q.BF16}[file_type]


@contextlib.contextmanager
def _quiet_writer():
    """The gguf package logs every file it writes at INFO; tcal reports what it wrote itself."""
    logger = logging.getLogger("gguf")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _write_out(w) -> None:
    """Write a filled GGUFWriter's header, metadata and tensors, and close it."""
    with _quiet_writer():
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file(progress=False)
        w.close()


def _add(w, gname: str, t: torch.Tensor, qtype):
    """Add one tensor to the writer in ``qtype``; returns ``qtype``."""
    import gguf

    data = t.contiguous().numpy().astype(np.float32)
    if qtype == gguf.GGMLQuantizationType.F32:
        w.add_tensor(gname, data)
    elif qtype == gguf.GGMLQuantizationType.F16:
        w.add_tensor(gname, data.astype(np.float16))
    else:
        w.add_tensor(gname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    return qtype


def write_gguf(path: Path, config: dict, state_dict: dict[str, torch.Tensor], vocab: GGUFVocab, file_type: str,
               *, name: str = "tcal hybrid", scaled: tuple[str, ...] = (), progress: bool = False,
               rope: GGUFRope = PLAIN_ROPE) -> dict:
    """Write ``path``; returns {gguf tensor name: type name}. ``scaled``: transformers names of the tensors that
    carry a linearised norm's scale (kept f32 where the file type cannot hold them). ``rope``: the teacher family's
    rule for the RoPE a GGUF holds (``Family.gguf_rope``; plain RoPE unless the family says more)."""
    import gguf

    if file_type not in FILE_TYPES:
        raise TcalError(f"unknown GGUF type {file_type!r}; choose one of {', '.join(FILE_TYPES)}")
    if file_type in QUANTISED:
        raise TcalError(f"write_gguf writes {', '.join(t for t in FILE_TYPES if t not in QUANTISED)}; {file_type} is "
                        "llama.cpp's quantiser applied to an f16 file (export_gguf does both)")
    check_rows(vocab, config["vocab_size"])
    rope_rule, rope = rope, config["rope_parameters"]
    why = rope_rule.blocker(rope, ARCH)  # the family's rule; qwen35 loads no RoPE tensor
    if why:
        raise TcalError(f"{why}: export --format hf instead")
    L = config["num_hidden_layers"]
    recurrent = [t == "linear_attention" for t in config["layer_types"]]
    with _quiet_writer():
        w = gguf.GGUFWriter(str(path), ARCH)
    w.add_name(name)
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[file_type])
    if file_type == "q8_0":
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(L)
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_rope_dimension_count(int(config["head_dim"] * rope["partial_rotary_factor"]))
    w.add_rope_dimension_sections([*rope["mrope_section"], 0])
    w.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    w.add_ssm_state_size(config["linear_key_head_dim"])
    w.add_ssm_group_count(config["linear_num_key_heads"])
    w.add_ssm_time_step_rank(config["linear_num_value_heads"])
    w.add_ssm_inner_size(config["linear_value_head_dim"] * config["linear_num_value_heads"])
    w.add_array(f"{ARCH}.attention.recurrent_layers", recurrent)
    interval = periodic_interval([i for i, r in enumerate(recurrent) if not r], L)
    if interval:
        w.add_full_attention_interval(interval)
    w.add_uint32(f"{ARCH}.vocab_size", config["vocab_size"])
    for key, value, vtype, sub in vocab.keys:
        w.add_key_value(key, value, gguf.GGUFValueType[vtype], sub_type=gguf.GGUFValueType[sub] if sub else None)

    from tqdm.auto import tqdm

    types = {}
    for hf_name, t in tqdm(state_dict.items(), desc=f"GGUF {file_type}", unit="tensor", disable=not progress,
                           leave=False):
        if hf_name.endswith("self_attn.o_proj.bias"):  # the layout's bias flag adds it; zero unless the teacher has one
            if bool(t.ne(0).any()):
                raise TcalError(f"{hf_name}: llama.cpp's qwen35 has no attention output bias; export --format hf")
            continue
        gname = gguf_name(hf_name)
        t = t.detach().float().cpu()
        if gname.endswith(_ZERO_CENTRED):
            t = t + 1.0
        elif gname.endswith("ssm_a"):
            t = -t.exp()
        elif gname.endswith("ssm_conv1d.weight"):
            t = t.squeeze(1)
        types[gname] = _add(w, gname, t, _tensor_type(gname, t, file_type, hf_name in scaled)).name
    _write_out(w)
    return types


def _keep_patterns(types: dict[str, str]) -> dict[str, str]:
    """{llama.cpp tensor-name regex: type} for the quantiser: every tensor of the f16 file that is not f16 (the
    scaled q/k weights in bf16, the small gate projections and the conv in f32) stays as it is."""
    return {f"^{n.replace('.', '[.]')}$": t for n, t in types.items() if t != "F16"}


def quantiser_needed(file_type: str) -> str:
    """The error where llama.cpp's quantiser is missing: --no-check cannot help, another type can."""
    return (f"a {file_type} GGUF is made by llama.cpp's quantiser, which comes with llama-cpp-python: pip install "
            "'tcal[gguf]', or export --gguf-type q8_0 (or f16), which tcal writes itself")


def quantise(src: Path, dst: Path, file_type: str, keep: dict[str, str], threads: int | None = None) -> None:
    """llama.cpp's quantiser (``llama_model_quantize``) from the GGUF ``src`` to ``dst`` in ``file_type``
    (:data:`QUANTISED`), with the tensors matching a ``keep`` pattern in the type named there."""
    import ctypes

    import gguf

    from tcal.engines.llamacpp import module

    try:
        lc = module(f"a {file_type} GGUF (llama.cpp's quantiser)")
    except TcalError:
        raise TcalError(quantiser_needed(file_type)) from None
    params = lc.llama_model_quantize_default_params()
    params.ftype = QUANTISED[file_type]
    params.nthread = threads or os.cpu_count() or 1
    overrides = (lc.llama_model_tensor_override * (len(keep) + 1))()  # the quantiser stops at a null pattern
    for o, (pattern, type_name) in zip(overrides, keep.items()):
        o.pattern = pattern.encode()
        o.type = int(gguf.GGMLQuantizationType[type_name])
    params.tt_overrides = ctypes.cast(overrides, ctypes.POINTER(lc.llama_model_tensor_override))
    lc.llama_backend_init()
    if lc.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise TcalError(f"llama.cpp's quantiser failed on {src.name} ({file_type}); export --gguf-type q8_0 instead")


def tensor_types(path: Path) -> dict[str, str]:
    """{tensor: type name} of a GGUF, as stored."""
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def export_gguf(model, path: Path, file_type: str, vocab: GGUFVocab | None = None, *, name: str = "tcal hybrid",
                progress: bool = False):
    """A tcal hybrid as a GGUF at ``path``; returns
    (its :class:`~tcal.export.qwen3_5.Layout`, {tensor: type})."""
    from tcal.export.vocab import no_vocab

    check_layout(model, "gguf")
    rule = families.of(model.config).gguf_rope
    layout = to_qwen3_5(model)
    vocab = vocab or no_vocab()
    if file_type not in QUANTISED:
        types = write_gguf(path, layout.config, layout.state_dict, vocab, file_type, name=name, scaled=layout.scaled,
                           progress=progress, rope=rule)
        return layout, types
    f16 = path.with_name(f".{path.name}.f16")
    try:
        types = write_gguf(f16, layout.config, layout.state_dict, vocab, "f16", name=name, scaled=layout.scaled,
                           progress=progress, rope=rule)
        with quiet_llama_cpp():
            quantise(f16, path, file_type, _keep_patterns(types))
    finally:
        f16.unlink(missing_ok=True)
    return layout, tensor_types(path)


def teacher_gguf_blocker(config) -> str | None:
    """Why tcal cannot write a plain teacher of this config as a GGUF (one line), or None: its family must say
    ``teacher_gguf`` (:mod:`tcal.families`) and hold its RoPE in its architecture (``Family.gguf_rope``)."""
    fam = families.find(getattr(config, "model_type", None))
    if fam is None or not fam.teacher_gguf:
        return (f"tcal writes llama.cpp GGUFs of {families.supported(lambda f: f.teacher_gguf)} teachers, not "
                f"{getattr(config, 'model_type', None)!r}")
    return fam.gguf_rope_blocker(config, fam.gguf_architecture)


def write_teacher_gguf(teacher, path: Path, file_type: str, *, progress: bool = False) -> dict:
    """A plain teacher of a family that says ``teacher_gguf`` as a GGUF of its family's llama.cpp architecture,
    without a tokenizer (token ids only): each tensor under the family's llama.cpp name, as its hook stores it, and
    the tensors its RoPE needs (:class:`~tcal.families.Family`). Returns {tensor: type}. A 4-bit type is llama.cpp's
    quantiser on the f16 file, as for a hybrid (its f32 tensors kept)."""
    import gguf

    if file_type in QUANTISED:
        f16 = path.with_name(f".{path.name}.f16")
        try:
            types = write_teacher_gguf(teacher, f16, "f16", progress=progress)
            with quiet_llama_cpp():
                quantise(f16, path, file_type, _keep_patterns(types))
        finally:
            f16.unlink(missing_ok=True)
        return tensor_types(path)
    cfg = teacher.config
    why = teacher_gguf_blocker(cfg)
    if why:
        raise TcalError(why)
    fam = families.of(cfg)
    arch = fam.gguf_architecture
    rope = rope_parameters(cfg)
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    with _quiet_writer():
        w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"{cfg.model_type} teacher")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_rope_dimension_count(d)
    w.add_uint32(f"{arch}.vocab_size", cfg.vocab_size)
    w.add_string("tokenizer.ggml.model", "none")
    from tqdm.auto import tqdm

    types = {}
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    for name, t in tqdm(teacher.state_dict().items(), desc=f"GGUF {file_type}", unit="tensor", disable=not progress,
                        leave=False):
        if name == "lm_head.weight" and tied:
            continue
        gname = fam.gguf_name(name)
        if gname is None:
            raise TcalError(f"{name}: llama.cpp's {arch} architecture has no tensor for it")
        t = fam.gguf_stored(gname, t.detach().float().cpu(), cfg)
        qtype = _tensor_type(gname, t, file_type, scaled=False)
        types[gname] = _add(w, gname, t, qtype).name
    for gname, values in fam.gguf_rope.tensors(cfg, arch).items():
        types[gname] = _add(w, gname, torch.tensor(values), gguf.GGMLQuantizationType.F32).name
    _write_out(w)
    return types
