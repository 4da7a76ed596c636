"""A tcal hybrid in the Qwen3.5 dense layout: its config and its ``Qwen3_5ForCausalLM`` weights.

The layout (transformers' ``modeling_qwen3_5``, vLLM's and SGLang's ``qwen3_5``, llama.cpp's ``qwen35``):

- GDN layers (``linear_attn``): one ``in_proj_qkv`` (no bias), a depthwise causal conv over concat(q, k, v)
  then SiLU, q and k l2-normalised, ``in_proj_b`` / ``in_proj_a`` (no bias) for beta = sigmoid(b) and
  g = -exp(A_log) softplus(a + dt_bias), a gated RMSNorm ``w * norm(o) * silu(in_proj_z x)`` (w itself, not
  1 + w), ``out_proj``. tcal's GatedDeltaNet computes the same with separate q/k/v projections and convs:
  the export concatenates them, and a GDN without short convs gets identity taps (exact).
- Attention layers: ``q_proj`` twice as wide, per head [q_h | gate_h], output = attention * sigmoid(gate);
  q and k always RMS-normalised per head. A zero gate row gives sigmoid(0) = 1/2, so o_proj is doubled
  (both exact in floating point).
- Decoder norms, and the attention q/k norms, are zero-centred: the stored weight is w - 1.

Teachers without q/k norm (Llama, Mistral, Qwen2/2.5): RMSNorm is linear where eps dominates, since
norm(a q) w = a q w / sqrt(a^2 mean(q^2) + eps) = q (1 + a^2 mean(q^2) / eps)^-1/2 for w = sqrt(eps) / a.
``linear_norm_scale`` picks a as the largest power of two whose relative error stays below
:data:`LINEAR_NORM_ERROR` for *every* input: the mean square of a head's q is bounded from the weights
(the layer input is an RMSNorm output, so its l2 norm is at most sqrt(D) max|w_in|). Powers of two scale
weights and activations without rounding in any float format that holds them; the scaled weights are tiny
and must stay in f32 or bf16 (fp16 flushes them to zero).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tcal import families
from tcal.conversion.target import LAYOUT_EPS, layout_blocker
from tcal.engines.placement import periodic_interval
from tcal.families.rope import rope_parameters
from tcal.utils.errors import TcalError

ARCHITECTURE = "Qwen3_5ForCausalLM"
MODEL_TYPE = "qwen3_5_text"
LLAMA_CPP_ARCH = "qwen35"  # llama.cpp's name for the layout
# worst-case relative error of a linearised q/k RMSNorm: fp32's unit roundoff
LINEAR_NORM_ERROR = 2.0**-24
# what the layout's GDN conv holds when the hybrid has no short conv (identity taps)
DEFAULT_CONV = 4


def _mean_square_bound(weight: torch.Tensor, bias: torch.Tensor | None, in_norm: torch.Tensor, heads: int) -> float:
    """Largest mean(q_h^2) over heads h and over every input, for q = weight x + bias and x an RMSNorm output
    times ``in_norm`` (so ||x|| <= sqrt(D) max|in_norm|)."""
    w = weight.detach().double()
    d = w.shape[0] // heads
    x_max = math.sqrt(w.shape[1]) * float(in_norm.detach().double().abs().max())
    sigma = torch.linalg.matrix_norm(w.view(heads, d, -1), ord=2)  # (heads,) largest singular values
    b = bias.detach().double().view(heads, d).norm(dim=-1) if bias is not None else torch.zeros(heads, dtype=w.dtype)
    return float(((sigma * x_max + b) ** 2).max()) / d


def linear_norm_scale(weight: torch.Tensor, bias: torch.Tensor | None, in_norm: torch.Tensor, heads: int,
                      eps: float) -> float:
    """The power of two a that makes a per-head RMSNorm of (a q) linear in q to within LINEAR_NORM_ERROR."""
    m = max(_mean_square_bound(weight, bias, in_norm, heads), 1e-30)
    # (1 + a^2 m / eps)^-1/2 >= 1 - a^2 m / (2 eps) >= 1 - LINEAR_NORM_ERROR
    return 2.0 ** math.floor(math.log2(math.sqrt(2 * LINEAR_NORM_ERROR * eps / m)))


def _nonzero(t: torch.Tensor | None) -> bool:
    return t is not None and bool(t.detach().ne(0).any())


@dataclass
class _Source:
    """What the mapping reads of a hybrid."""
    model: object
    base: object  # the teacher's config, with the hybrid's own eps where the target changed it
    layer_types: list[str]
    gdns: dict
    gdn_shape: object

    @classmethod
    def of(cls, model) -> _Source:
        cfg = model.config
        if cfg.model_type != "tcal_hybrid":
            raise TcalError(f"the export maps tcal hybrids; this is a {cfg.model_type!r} model")
        return cls(model, cfg.teacher_config(), list(cfg.layer_types), model.gdn_modules(), cfg.gdn_shape())

    @property
    def family(self) -> families.Family:
        return families.of(self.base)

    def attention(self, i: int) -> families.AttentionWeights:
        """Kept attention layer ``i``'s tensors under q/k/v/o names, whatever the teacher family stores."""
        return self.family.attention_weights(self.model.model.layers[i].self_attn)

    @property
    def head_dim(self) -> int:
        return getattr(self.base, "head_dim", None) or self.base.hidden_size // self.base.num_attention_heads

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t != "linear_attention"]


def blocker(model) -> str | None:
    """The first thing that keeps the layout from expressing ``model`` exactly (one line), or None."""
    return teacher_blocker(model) or _gdn_blocker(_Source.of(model))


def teacher_blocker(model) -> str | None:
    """Why the layout cannot hold this hybrid of its teacher (its family, activation, MLP biases, sliding window,
    and the family's own rule for the layers it keeps as attention: no conversion target changes these), or
    None."""
    src = _Source.of(model)
    return layout_blocker(src.base, src.attention_layers)


def _gdn_blocker(src: _Source) -> str | None:
    """What a hybrid built for tcal's native layout carries that the layout's GDN layers have not."""
    eps = src.base.rms_norm_eps
    for i, gdn in src.gdns.items():
        p = f"model.layers.{i}.self_attn"
        for name in ("q_proj", "k_proj", "v_proj", "b_proj", "o_proj"):
            if _nonzero(getattr(gdn, name).bias):
                return f"{p}.{name}.bias: the layout's GDN projections have no bias"
        if gdn.shape.qk_norm:
            return f"{p}.q_norm.weight: the layout's GDN normalises q and k by their l2 norm only"
        if not gdn.shape.output_gate:
            return f"{p}.g_proj: the layout's GDN always gates its output (this hybrid was built without the gate)"
        if gdn.o_norm.eps != eps:
            return (f"{p}.o_norm: eps {gdn.o_norm.eps:g}, the decoder norms' {eps:g}; the layout has one eps for "
                    "every norm")
    return None


def _rope(base, head_dim: int) -> dict:
    """The teacher's RoPE as Qwen3.5 rope_parameters: full rotary unless the teacher's is partial, and M-RoPE
    sections that sum to half the rotary dims (every section sees the same position for text, so any split
    is plain RoPE; engines check the sum)."""
    rope = rope_parameters(base)
    factor = float(rope.get("partial_rotary_factor", getattr(base, "partial_rotary_factor", None) or 1.0))
    half = int(head_dim * factor) // 2
    s0 = -(-half // 3)
    s1 = -(-(half - s0) // 2)
    rope.update(partial_rotary_factor=factor, mrope_section=[s0, s1, half - s0 - s1], mrope_interleaved=True)
    return rope


def _attention_bias(src: _Source) -> bool:
    return any(src.attention(i).proj(n)[1] is not None for i in src.attention_layers for n in "qkvo")


def _config(src: _Source) -> dict:
    """``Qwen3_5TextConfig`` fields of the exported model (``config.json`` of a ``Qwen3_5ForCausalLM``), and the keys
    the serving engines read besides (:data:`ENGINE_KEYS`; docs/serving.md says which engine reads which)."""
    base, gdn = src.base, src.gdn_shape
    rope = _rope(base, src.head_dim)
    bias = _attention_bias(src)
    interval = periodic_interval(src.attention_layers, len(src.layer_types))
    config = {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "vocab_size": base.vocab_size, "hidden_size": base.hidden_size, "intermediate_size": base.intermediate_size,
        "num_hidden_layers": base.num_hidden_layers, "num_attention_heads": base.num_attention_heads,
        "num_key_value_heads": base.num_key_value_heads or base.num_attention_heads, "head_dim": src.head_dim,
        "hidden_act": "silu", "max_position_embeddings": base.max_position_embeddings,
        "initializer_range": getattr(base, "initializer_range", 0.02), "rms_norm_eps": base.rms_norm_eps,
        "use_cache": True, "tie_word_embeddings": bool(getattr(base, "tie_word_embeddings", False)),
        "rope_parameters": rope, "attention_bias": bias, "attention_dropout": 0.0,
        "linear_conv_kernel_dim": gdn.conv_size if gdn.use_short_conv else DEFAULT_CONV,
        "linear_key_head_dim": gdn.head_dim, "linear_value_head_dim": gdn.head_dim,
        "linear_num_key_heads": gdn.num_heads, "linear_num_value_heads": gdn.num_heads,
        "layer_types": list(src.layer_types),
        "bos_token_id": base.bos_token_id, "eos_token_id": base.eos_token_id, "pad_token_id": base.pad_token_id,
        # vLLM: attention q/k/v biases follow qkv_bias (not attention_bias); the GDN state in float32, not the
        # model's dtype. SGLang: the top-level rotary factor (its default is 0.25) and theta.
        "qkv_bias": bias, "mamba_ssm_dtype": "float32",
        "partial_rotary_factor": rope["partial_rotary_factor"], "rope_theta": rope["rope_theta"],
    }
    if interval:  # SGLang places attention by it alone; written only where it says what layer_types says
        config["full_attention_interval"] = interval
    return config


# keys of the exported config.json that transformers' Qwen3_5TextConfig does not keep when it saves itself (it folds
# the top-level rotary factor and theta into rope_parameters); the export writes them back for the engines
ENGINE_KEYS = ("partial_rotary_factor", "rope_theta", "qkv_bias", "mamba_ssm_dtype", "full_attention_interval")


def _gdn_tensors(gdn, prefix: str) -> dict[str, torch.Tensor]:
    n = gdn.num_heads * gdn.head_dim
    if gdn.shape.use_short_conv:
        conv = torch.cat([c.weight for c in (gdn.q_conv1d, gdn.k_conv1d, gdn.v_conv1d)], 0)  # (3 n, 1, W)
    else:
        conv = gdn.q_proj.weight.new_zeros(3 * n, 1, DEFAULT_CONV)
        conv[..., -1] = 1.0
    return {
        f"{prefix}.in_proj_qkv.weight": torch.cat([gdn.q_proj.weight, gdn.k_proj.weight, gdn.v_proj.weight], 0),
        f"{prefix}.conv1d.weight": conv,
        f"{prefix}.in_proj_z.weight": gdn.g_proj.weight,
        f"{prefix}.in_proj_b.weight": gdn.b_proj.weight,
        f"{prefix}.in_proj_a.weight": gdn.a_proj.weight,
        f"{prefix}.A_log": gdn.A_log,
        f"{prefix}.dt_bias": gdn.dt_bias,
        f"{prefix}.norm.weight": gdn.o_norm.weight,  # the gated norm multiplies by w itself
        f"{prefix}.out_proj.weight": gdn.o_proj.weight,
    }


def _with_gate_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(H d, ...) -> (2 H d, ...): each head's rows followed by as many zero rows (its output gate)."""
    per_head = t.reshape(heads, -1, *t.shape[1:])
    return torch.cat([per_head, torch.zeros_like(per_head)], 1).reshape(2 * t.shape[0], *t.shape[1:])


def _attention_tensors(attn: families.AttentionWeights, in_norm: torch.Tensor, prefix: str, heads: int,
                       kv_heads: int, eps: float, with_bias: bool) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The kept attention layer's tensors, and the scale of its q and k (1.0: the teacher's own norm)."""
    out: dict[str, torch.Tensor] = {}
    scales = {}
    for name, h in (("q", heads), ("k", kv_heads)):
        weight, bias = attn.proj(name)
        norm = getattr(attn, f"{name}_norm")
        if norm is not None:  # the teacher's own q/k norm (Qwen3): zero-centred, otherwise as it is
            scale, norm_w = 1.0, norm.float()
        else:
            scale = linear_norm_scale(weight, bias, in_norm, h, eps)
            norm_w = torch.full((weight.shape[0] // h,), math.sqrt(eps) / scale, dtype=torch.float32)
        scales[name] = scale
        out[f"{prefix}.{name}_norm.weight"] = norm_w - 1.0
    q_w = attn.q * scales["q"]
    out[f"{prefix}.q_proj.weight"] = _with_gate_rows(q_w, heads)
    out[f"{prefix}.k_proj.weight"] = attn.k * scales["k"]
    out[f"{prefix}.v_proj.weight"] = attn.v
    out[f"{prefix}.o_proj.weight"] = attn.o * 2.0  # sigmoid(0) = 1/2 on every output
    if with_bias:
        def bias(name):
            weight, b = attn.proj(name)
            return b if b is not None else attn.q.new_zeros(weight.shape[0])
        out[f"{prefix}.q_proj.bias"] = _with_gate_rows(bias("q") * scales["q"], heads)
        out[f"{prefix}.k_proj.bias"] = bias("k") * scales["k"]
        out[f"{prefix}.v_proj.bias"] = bias("v")
        out[f"{prefix}.o_proj.bias"] = bias("o")
    return out, scales


ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")


@dataclass
class Layout:
    """A hybrid in the Qwen3.5 layout: ``config`` (Qwen3_5TextConfig fields), ``state_dict`` (fp32, transformers'
    names, zero-centred norms), and per kept attention layer how its q/k norms were made."""
    config: dict
    state_dict: dict[str, torch.Tensor]
    qk_norms: dict[int, dict[str, str]] = field(default_factory=dict)
    scaled: tuple[str, ...] = ()  # tensors that carry a linearised norm's power-of-two scale

    def record(self) -> dict:
        return {str(i): v for i, v in self.qk_norms.items()}


@torch.no_grad()
def to_qwen3_5(model) -> Layout:
    """A tcal hybrid in the layout; a TcalError naming the first tensor the layout cannot express."""
    check_layout(model)
    src = _Source.of(model)
    config = _config(src)
    eps = src.base.rms_norm_eps
    with_bias = config["attention_bias"]
    sd: dict[str, torch.Tensor] = {}
    norms: dict[int, dict[str, str]] = {}
    scaled: list[str] = []
    tied = bool(getattr(src.base, "tie_word_embeddings", False))
    for key, tensor in model.state_dict().items():
        parts = key.split(".")
        if key.startswith("model.layers.") and parts[3] == "self_attn":
            continue  # mixers below
        if key == "lm_head.weight" and tied:
            continue
        for name, t in src.family.split_fused(key, tensor):  # a fused gate_up MLP as the layout's gate and up
            t = t.float()
            if name == "model.norm.weight" or name.endswith(ZERO_CENTRED):
                t = t - 1.0
            sd[name] = t
    for i, layer in enumerate(model.model.layers):
        if i in src.gdns:
            sd.update({k: v.float() for k, v in _gdn_tensors(src.gdns[i], f"model.layers.{i}.linear_attn").items()})
            continue
        prefix = f"model.layers.{i}.self_attn"
        tensors, scales = _attention_tensors(src.attention(i), layer.input_layernorm.weight, prefix,
                                             config["num_attention_heads"], config["num_key_value_heads"], eps,
                                             with_bias)
        sd.update({k: v.float() for k, v in tensors.items()})
        norms[i] = {f"{n}_norm": "the teacher's" if a == 1.0 else f"linear, scale 2^{int(math.log2(a))}"
                    for n, a in scales.items()}
        scaled += [f"{prefix}.{n}_proj.{p}" for n, a in scales.items() if a != 1.0 for p in ("weight", "bias")
                   if f"{prefix}.{n}_proj.{p}" in tensors]
    return Layout(config, {k: v.detach().contiguous() for k, v in sd.items()}, norms, tuple(scaled))


def check_layout(model, fmt: str = "hf") -> None:
    """A one-line TcalError where the layout, or the format's engine, cannot run ``model`` as it is.

    llama.cpp l2-normalises the GDN's q and k with the model's RMSNorm eps where every other engine, and tcal,
    add 1e-6: a GGUF is the hybrid only when the two agree."""
    why = teacher_blocker(model)
    if why:
        raise TcalError(f"the Qwen3.5 layout cannot hold any hybrid of this teacher: {why}. No conversion target "
                        "changes that: this hybrid runs where tcal is imported (transformers with tcal, tcal's "
                        "FastDecoder), not in vLLM, SGLang or llama.cpp")
    src = _Source.of(model)
    why = _gdn_blocker(src)
    if why:
        raise TcalError(f"the Qwen3.5 layout cannot express this hybrid: {why}; convert with --target qwen3_5")
    if fmt == "gguf":
        why = src.family.gguf_rope_blocker(src.base, LLAMA_CPP_ARCH)  # the family's rule for its RoPE
        if why:
            raise TcalError(f"{why}: export --format hf instead")
    eps = src.base.rms_norm_eps
    if fmt == "gguf" and eps != LAYOUT_EPS:
        raise TcalError(f"the hybrid's RMSNorm eps is {eps:g}; llama.cpp would l2-normalise its GDN q and k with it "
                        f"where the hybrid uses {LAYOUT_EPS:g}: convert with --target qwen3_5 (eps {LAYOUT_EPS:g})")
