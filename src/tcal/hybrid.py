"""Hybrid attention / Gated DeltaNet model: config, model, conversion surgery.

The hybrid *is* the teacher's own architecture (its HF modeling code builds the embeddings,
decoder layers, norms and MLPs) with the converted layers' ``self_attn`` swapped for a
:class:`~tcal.gdn.GatedDeltaNet`. Nothing is vendored: the teacher's config travels inside
``HybridConfig.base_config`` and transformers rebuilds the teacher's model class from it, so
a saved hybrid loads with ``AutoModelForCausalLM.from_pretrained(dir)`` once ``tcal`` is
imported, without the teacher's weights and without ``trust_remote_code``. State-dict keys are
the teacher's (``model.layers.3.self_attn.q_proj.weight``...), so kept layers can be checked
against the teacher key by key.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
from huggingface_hub.dataclasses import strict
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from tcal import compat
from tcal.atomic import atomic_dir
from tcal.errors import TcalError
from tcal.gdn import GatedDeltaNet, GDNShape

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
LINEAR, FULL = "linear_attention", "full_attention"
# Fields the generation / cache machinery reads off the top-level config.
_MIRRORED = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "rms_norm_eps", "initializer_range", "tie_word_embeddings",
    "pad_token_id", "bos_token_id", "eos_token_id", "sliding_window",
)


@strict(accept_kwargs=True)
class HybridConfig(PreTrainedConfig):
    """Config of a tcal hybrid: the teacher's config plus which layers are GDN and how GDN is built."""

    model_type = "tcal_hybrid"

    base_config: dict | None = None  # the teacher's config.to_dict()
    layer_types: list[str] | None = None  # "full_attention" / "linear_attention" per layer
    gdn_use_short_conv: bool = False
    gdn_conv_size: int = 4
    gdn_qkv_bias: bool = False
    gdn_o_bias: bool = False
    gdn_qk_norm: bool = False
    gdn_output_gate: bool = True
    gdn_norm_eps: float = 1e-5
    gdn_backend: str = "auto"
    gdn_chunk_size: int = 64
    # Mirrors of the teacher's fields (filled from base_config).
    vocab_size: int | None = None
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int | None = None
    rms_norm_eps: float | None = None
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    sliding_window: int | None = None
    use_cache: bool = True

    def __post_init__(self, **kwargs):
        if self.base_config is not None:
            base = self.base_config
            for name in _MIRRORED:
                if getattr(self, name) is None and base.get(name) is not None:
                    setattr(self, name, base[name])
            if self.head_dim is None and self.hidden_size and self.num_attention_heads:
                self.head_dim = self.hidden_size // self.num_attention_heads
            if self.num_key_value_heads is None:
                self.num_key_value_heads = self.num_attention_heads
            if "tie_word_embeddings" in base:
                self.tie_word_embeddings = base["tie_word_embeddings"]
        super().__post_init__(**kwargs)

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types or []) if t == LINEAR]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types or []) if t != LINEAR]

    def teacher_config(self) -> PreTrainedConfig:
        base = dict(self.base_config)
        cfg = AutoConfig.for_model(base.pop("model_type"), **base)
        cfg._attn_implementation = self._attn_implementation
        return cfg

    def gdn_shape(self) -> GDNShape:
        return GDNShape(
            hidden_size=self.hidden_size, num_heads=self.num_attention_heads, head_dim=self.head_dim,
            use_short_conv=self.gdn_use_short_conv, conv_size=self.gdn_conv_size, qkv_bias=self.gdn_qkv_bias,
            o_bias=self.gdn_o_bias, qk_norm=self.gdn_qk_norm, output_gate=self.gdn_output_gate,
            norm_eps=self.gdn_norm_eps, backend=self.gdn_backend, chunk_size=self.gdn_chunk_size,
        )


class HybridPreTrainedModel(PreTrainedModel):
    config_class = HybridConfig
    config: HybridConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = False

    @torch.no_grad()
    def _init_weights(self, module):
        if isinstance(module, GatedDeltaNet):
            module.reset_parameters(std=self.config.initializer_range)
        else:
            super()._init_weights(module)


class HybridForCausalLM(HybridPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: HybridConfig):
        super().__init__(config)
        if not config.base_config or not config.layer_types:
            raise TcalError("HybridConfig needs base_config (the teacher's config) and layer_types")
        self.model = AutoModel.from_config(config.teacher_config())
        shape = config.gdn_shape()
        for i in config.gdn_layers:
            self.model.layers[i].self_attn = GatedDeltaNet(shape, layer_idx=i)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def save_pretrained(self, save_directory, *args, atomic: bool = True, **kwargs):
        """transformers' save_pretrained (safetensors only), written atomically unless the caller
        already writes into a temporary directory of its own (``atomic=False``)."""
        if not atomic:
            return super().save_pretrained(save_directory, *args, **kwargs)
        with atomic_dir(save_directory) as tmp:
            super().save_pretrained(tmp, *args, **kwargs)

    def gdn_modules(self) -> dict[int, GatedDeltaNet]:
        return {i: self.model.layers[i].self_attn for i in self.config.gdn_layers}

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        cache = compat.cache_from_kwargs(kwargs)
        for name in ("cache", "past_key_values"):
            kwargs.pop(name, None)
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        if use_cache and cache is None:
            cache = compat.make_cache(self.config)
        if attention_mask is not None and attention_mask.dim() == 2:
            T = (input_ids if input_ids is not None else inputs_embeds).shape[1]
            new = attention_mask[:, -T:]
            # Decided once per forward: a check inside each GDN layer was a GPU->host sync per layer
            # per generated token. generate() passes an all-ones mask when nothing is padded.
            if not bool(new.all()):
                kwargs["tcal_keep"] = new.to(torch.float32)  # (B, T): 0 at padded positions
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            inputs_embeds=inputs_embeds, use_cache=use_cache, **{compat.CACHE_KWARG: cache}, **kwargs,
        )
        hidden = out.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, hidden_states=getattr(out, "hidden_states", None),
            attentions=getattr(out, "attentions", None), **{compat.CACHE_KWARG: cache if use_cache else None},
        )


AutoConfig.register(HybridConfig.model_type, HybridConfig, exist_ok=True)
AutoModelForCausalLM.register(HybridConfig, HybridForCausalLM, exist_ok=True)


# ---------------------------------------------------------------------------------------------
# Surgery
# ---------------------------------------------------------------------------------------------


def check_teacher(teacher: PreTrainedModel) -> None:
    model_type = getattr(teacher.config, "model_type", None)
    if model_type == HybridConfig.model_type:
        raise TcalError("the teacher is already a tcal hybrid; convert the original Transformer instead")
    if model_type not in SUPPORTED_FAMILIES:
        raise TcalError(
            f"unsupported architecture {model_type!r}; tcal converts {', '.join(SUPPORTED_FAMILIES)} "
            "decoder-only models"
        )


def check_keep(keep: Sequence[int], num_layers: int) -> list[int]:
    """Validate an explicit list of layers kept as softmax attention."""
    try:
        keep = [int(i) for i in keep]
    except (TypeError, ValueError):
        raise TcalError(f"keep must be a list of layer indices, got {keep!r}") from None
    if not keep:
        raise TcalError(
            "keep is empty: keep at least one softmax-attention layer (tcal builds hybrids; "
            "an all-GDN model is not supported)"
        )
    bad = [i for i in keep if not 0 <= i < num_layers]
    if bad:
        raise TcalError(f"keep index {bad[0]} out of range: the teacher has {num_layers} layers (0..{num_layers - 1})")
    dupes = sorted({i for i in keep if keep.count(i) > 1})
    if dupes:
        raise TcalError(f"keep lists layer {dupes[0]} more than once; give each layer index once")
    if len(keep) == num_layers:
        raise TcalError(f"keep lists all {num_layers} layers: nothing would be converted; keep fewer layers")
    return sorted(keep)


def hybrid_config_for(teacher: PreTrainedModel, keep: Sequence[int], **gdn_options) -> HybridConfig:
    check_teacher(teacher)
    tcfg = teacher.config
    keep = check_keep(keep, tcfg.num_hidden_layers)
    attn = teacher.model.layers[keep[0]].self_attn
    teacher_types = getattr(tcfg, "layer_types", None) or [FULL] * tcfg.num_hidden_layers
    layer_types = [teacher_types[i] if i in keep else LINEAR for i in range(tcfg.num_hidden_layers)]
    base = tcfg.to_dict()
    options = {
        "gdn_qkv_bias": attn.q_proj.bias is not None,
        "gdn_o_bias": attn.o_proj.bias is not None,
        "gdn_qk_norm": hasattr(attn, "q_norm"),
        "gdn_norm_eps": getattr(tcfg, "rms_norm_eps", 1e-5),
    }
    for name, value in gdn_options.items():
        key = name if name.startswith("gdn_") else f"gdn_{name}"
        if key not in HybridConfig.__dataclass_fields__:
            raise TcalError(f"unknown GDN option {name!r}")
        options[key] = value
    cfg = HybridConfig(base_config=base, layer_types=layer_types, **options)
    cfg._attn_implementation = tcfg._attn_implementation
    return cfg


def repeat_kv_rows(w: torch.Tensor, num_kv_heads: int, num_heads: int) -> torch.Tensor:
    """(KV * d, ...) -> (H * d, ...): each KV head's rows repeated for its query group (HF repeat_kv order)."""
    d = w.shape[0] // num_kv_heads
    return w.reshape(num_kv_heads, d, *w.shape[1:]).repeat_interleave(num_heads // num_kv_heads, dim=0).reshape(
        num_heads * d, *w.shape[1:]
    )


@torch.no_grad()
def copy_attention_into_gdn(attn: nn.Module, gdn: GatedDeltaNet, num_kv_heads: int) -> None:
    """W_q, W_o copied; W_k, W_v repeated per GQA group; biases and q/k norms carried."""
    H = gdn.num_heads
    gdn.q_proj.weight.copy_(attn.q_proj.weight)
    gdn.k_proj.weight.copy_(repeat_kv_rows(attn.k_proj.weight, num_kv_heads, H))
    gdn.v_proj.weight.copy_(repeat_kv_rows(attn.v_proj.weight, num_kv_heads, H))
    gdn.o_proj.weight.copy_(attn.o_proj.weight)
    if gdn.shape.qkv_bias:
        gdn.q_proj.bias.copy_(attn.q_proj.bias)
        gdn.k_proj.bias.copy_(repeat_kv_rows(attn.k_proj.bias, num_kv_heads, H))
        gdn.v_proj.bias.copy_(repeat_kv_rows(attn.v_proj.bias, num_kv_heads, H))
    if gdn.shape.o_bias:
        gdn.o_proj.bias.copy_(attn.o_proj.bias)
    if gdn.shape.qk_norm:
        gdn.q_norm.weight.copy_(attn.q_norm.weight)
        gdn.k_norm.weight.copy_(attn.k_norm.weight)


def build_hybrid(teacher: PreTrainedModel, keep: Sequence[int], seed: int = 0, **gdn_options) -> HybridForCausalLM:
    """The hybrid with every teacher weight in place and GDN layers in fla-default init + copied projections."""
    cfg = hybrid_config_for(teacher, keep, **gdn_options)
    param = next(teacher.parameters())
    with torch.device(param.device):
        hybrid = HybridForCausalLM(cfg).to(param.dtype)
    gdn_prefixes = tuple(f"model.layers.{i}.self_attn." for i in cfg.gdn_layers)
    state = {k: v for k, v in teacher.state_dict().items() if not k.startswith(gdn_prefixes)}
    missing, unexpected = hybrid.load_state_dict(state, strict=False)
    stray = [k for k in missing if not k.startswith(gdn_prefixes) and k != "lm_head.weight"]
    stray += list(unexpected)
    if stray:
        raise TcalError(f"teacher and hybrid layouts differ at {stray[0]!r}; is this a supported architecture?")
    gen = torch.Generator(device=param.device).manual_seed(seed)
    for i, gdn in hybrid.gdn_modules().items():
        gdn.reset_parameters(std=cfg.initializer_range, generator=gen)
        copy_attention_into_gdn(teacher.model.layers[i].self_attn, gdn, cfg.num_key_value_heads)
    if teacher.generation_config is not None:
        hybrid.generation_config = teacher.generation_config
    hybrid.train(teacher.training)
    return hybrid
