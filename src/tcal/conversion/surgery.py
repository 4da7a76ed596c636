"""Surgery: a teacher and the layers it keeps as attention -> a hybrid with every teacher weight in
place and the converted layers' projections copied into fresh GDN layers."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel
from transformers.initialization import no_init_weights

from tcal import families
from tcal.conversion.policy import layer_index
from tcal.conversion.target import DEFAULT_TARGET, target_options
from tcal.models.configuration_hybrid import FULL, LINEAR, HybridConfig
from tcal.models.modeling_hybrid import HybridForCausalLM
from tcal.modules.gdn import GatedDeltaNet
from tcal.utils.errors import TcalError


def check_teacher(teacher: PreTrainedModel) -> families.Family:
    """The teacher's family (:mod:`tcal.families`); a TcalError for a hybrid or a family tcal does not convert."""
    model_type = getattr(teacher.config, "model_type", None)
    if model_type == HybridConfig.model_type:
        raise TcalError("the teacher is already a tcal hybrid; convert the original Transformer instead")
    fam = families.find(model_type)
    if fam is None or fam.model_type != model_type:  # a vision-language checkpoint converts once its decoder loads
        raise TcalError(f"unsupported architecture {model_type!r}; tcal converts {families.supported()} "
                        "decoder-only models")
    return fam


def check_keep(keep: Sequence[int], num_layers: int) -> list[int]:
    """Validate an explicit list of layers kept as softmax attention."""
    if isinstance(keep, (str, bytes)) or not hasattr(keep, "__iter__"):
        raise TcalError(f"keep must be a list of layer indices, got {keep!r}")
    keep = [layer_index(i) for i in keep]
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


def hybrid_config_for(teacher: PreTrainedModel, keep: Sequence[int], target: str = DEFAULT_TARGET,
                      **gdn_options) -> HybridConfig:
    fam = check_teacher(teacher)
    tcfg = teacher.config
    keep = check_keep(keep, tcfg.num_hidden_layers)
    attn = fam.attention_weights(teacher.model.layers[keep[0]].self_attn)
    teacher_types = getattr(tcfg, "layer_types", None) or [FULL] * tcfg.num_hidden_layers
    layer_types = [teacher_types[i] if i in keep else LINEAR for i in range(tcfg.num_hidden_layers)]
    target, fixed, base_over = target_options(target, tcfg, keep)
    base = {**tcfg.to_dict(), **base_over}
    options = {
        "gdn_qkv_bias": attn.q_bias is not None,
        "gdn_o_bias": attn.o_bias is not None,
        "gdn_qk_norm": attn.q_norm is not None,
        "gdn_norm_eps": getattr(tcfg, "rms_norm_eps", 1e-5),
        **fixed,
    }
    for name, value in gdn_options.items():
        key = name if name.startswith("gdn_") else f"gdn_{name}"
        if key not in HybridConfig.__dataclass_fields__:
            raise TcalError(f"unknown GDN option {name!r}")
        if key in fixed and value != fixed[key]:
            raise TcalError(f"GDN option {name}={value!r} does not fit --target {target} (it needs "
                            f"{fixed[key]!r}); drop the option or convert with --target native")
        options[key] = value
    cfg = HybridConfig(base_config=base, layer_types=layer_types, target=target, **options)
    cfg._attn_implementation = tcfg._attn_implementation
    return cfg


def repeat_kv_rows(w: torch.Tensor, num_kv_heads: int, num_heads: int) -> torch.Tensor:
    """(KV * d, ...) -> (H * d, ...): each KV head's rows repeated for its query group (HF repeat_kv order)."""
    d = w.shape[0] // num_kv_heads
    return w.reshape(num_kv_heads, d, *w.shape[1:]).repeat_interleave(num_heads // num_kv_heads, dim=0).reshape(
        num_heads * d, *w.shape[1:]
    )


@torch.no_grad()
def copy_attention_into_gdn(attn: families.AttentionWeights, gdn: GatedDeltaNet, num_kv_heads: int,
                            zero_centred: bool = False) -> None:
    """W_q, W_o copied; W_k, W_v repeated per GQA group; biases and q/k norms carried where the GDN layer has them
    (``zero_centred``: the teacher's norms multiply by 1 + w). ``attn``: the teacher layer's
    :meth:`~tcal.families.Family.attention_weights`."""
    H = gdn.num_heads
    gdn.q_proj.weight.copy_(attn.q)
    gdn.k_proj.weight.copy_(repeat_kv_rows(attn.k, num_kv_heads, H))
    gdn.v_proj.weight.copy_(repeat_kv_rows(attn.v, num_kv_heads, H))
    gdn.o_proj.weight.copy_(attn.o)
    if gdn.shape.qkv_bias:
        gdn.q_proj.bias.copy_(attn.q_bias)
        gdn.k_proj.bias.copy_(repeat_kv_rows(attn.k_bias, num_kv_heads, H))
        gdn.v_proj.bias.copy_(repeat_kv_rows(attn.v_bias, num_kv_heads, H))
    if gdn.shape.o_bias:
        gdn.o_proj.bias.copy_(attn.o_bias)
    if gdn.shape.qk_norm:
        shift = 1.0 if zero_centred else 0.0
        gdn.q_norm.weight.copy_(attn.q_norm + shift)
        gdn.k_norm.weight.copy_(attn.k_norm + shift)


def build_hybrid(teacher: PreTrainedModel, keep: Sequence[int], seed: int = 0, target: str = DEFAULT_TARGET,
                 share_weights: bool = False, **gdn_options) -> HybridForCausalLM:
    """The hybrid with every teacher weight in place and GDN layers in fla-default init + copied projections;
    ``target`` (:mod:`tcal.conversion.target`) says which layout it must fit.

    ``share_weights``: the hybrid's unchanged tensors (embeddings, MLPs, norms, kept attention, LM head) are the
    teacher's own, not copies, so converting costs the memory of the GDN layers only. Safe while only the GDN
    layers train (every init does); anything that changes a shared tensor in place changes the teacher too, so
    save the hybrid, or :func:`unshare` it, before training it whole."""
    cfg = hybrid_config_for(teacher, keep, target, **gdn_options)
    param = next(teacher.parameters())
    # every weight is the teacher's or set below, so the random inits of construction (torch's and transformers',
    # over the whole model and its embeddings) would be drawn only to be overwritten; without them the tying
    # that transformers does inside init_weights is done here
    with torch.device(param.device), no_init_weights():
        hybrid = HybridForCausalLM(cfg).to(param.dtype)
    hybrid.tie_weights()
    gdn_prefixes = tuple(f"model.layers.{i}.self_attn." for i in cfg.gdn_layers)
    state = {k: v for k, v in teacher.state_dict().items() if not k.startswith(gdn_prefixes)}
    # assign: the teacher's tensors themselves; the hybrid's own were allocated uninitialised and, never written,
    # never became resident memory
    missing, unexpected = hybrid.load_state_dict(state, strict=False, assign=share_weights)
    if share_weights:
        hybrid.tie_weights()  # tied parameters are one object again, as save_pretrained expects
    stray = [k for k in missing if not k.startswith(gdn_prefixes) and k != "lm_head.weight"]
    stray += list(unexpected)
    if stray:
        raise TcalError(f"teacher and hybrid layouts differ at {stray[0]!r}; is this a supported architecture?")
    gen = torch.Generator(device=param.device).manual_seed(seed)
    fam = families.of(teacher.config)
    for i, gdn in hybrid.gdn_modules().items():
        gdn.reset_parameters(std=cfg.initializer_range, generator=gen)
        copy_attention_into_gdn(fam.attention_weights(teacher.model.layers[i].self_attn), gdn,
                                cfg.num_key_value_heads, zero_centred=fam.zero_centred_norms)
    if teacher.generation_config is not None:
        hybrid.generation_config = teacher.generation_config
    hybrid.train(teacher.training)
    return hybrid




def unshare(hybrid: HybridForCausalLM, teacher: PreTrainedModel) -> HybridForCausalLM:
    """Give the hybrid its own copy of every tensor it shares with ``teacher`` (``build_hybrid(share_weights=True)``),
    so that training it whole leaves the teacher as it was."""
    ptrs = {t.data_ptr() for t in teacher.state_dict().values()}
    with torch.no_grad():
        for module in hybrid.modules():
            for p in list(module.parameters(recurse=False)):
                if p.data_ptr() in ptrs:
                    p.data = p.data.clone()
            for name, b in list(module.named_buffers(recurse=False)):
                if b.data_ptr() in ptrs:
                    module._buffers[name] = b.clone()
    hybrid.tie_weights()
    return hybrid
