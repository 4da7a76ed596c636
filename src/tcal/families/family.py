"""What tcal knows of one teacher family, as plain data: a :class:`Family` per module of this package.

A family is a transformers ``model_type`` whose decoder tcal converts. Its entry names the transformers classes, how
its attention and MLP projections are stored (separate or fused), whether its RMSNorms multiply by ``w`` or by
``1 + w``, its llama.cpp architecture, whether the Qwen3.5 layout (``--target qwen3_5``, ``tcal export``) and
``FastDecoder`` hold it, its tokenizer's pre-tokenizer as llama.cpp names it, how a GGUF of it stores its tensors
and its RoPE (llama.cpp's tensor names, a hook for what llama.cpp stores in another order, :class:`GGUFRope`), the
public shapes of real models of it (``tcal bench``) and the config of a small random model of it (tests, examples).
Everything tcal does with a teacher reads these facts here; nothing else names a family.

Torch is imported only by the functions that read a model's tensors, so ``import tcal`` and ``tcal --help`` stay
light.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from tcal.families.rope import PLAIN_ROPE, GGUFRope, rope_parameters

# llama.cpp's names of the embedding, the final norm and the LM head: the same in every architecture tcal writes
GGUF_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "lm_head.weight": "output.weight"}
# llama.cpp's names of a decoder layer's tensors (blk.N.<name>) where its architecture is of the Llama kind (its
# converter's tensor map): a family that writes its teachers as GGUFs (teacher_gguf) states its own only where it
# differs
GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


@dataclass(frozen=True)
class Attention:
    """Where a family's attention module (``model.layers[i].self_attn``) keeps its projections: ``q``, ``k``, ``v``,
    ``o`` (``nn.Linear``, optional biases), or one fused ``qkv`` whose rows are [q | k | v]; and its optional per-head
    RMSNorms of q and k."""

    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    qkv: str | None = None
    q_norm: str = "q_norm"
    k_norm: str = "k_norm"


@dataclass(frozen=True)
class Mlp:
    """Where a family's MLP keeps its projections: ``gate``, ``up`` and ``down``, or one fused ``gate_up`` whose rows are
    [gate | up]; the MLP computes down(act(gate x) * up x) either way."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    gate_up: str | None = None


@dataclass
class AttentionWeights:
    """A teacher attention layer's tensors under one set of names, whatever the family stores: q (H d, D),
    k and v (KV d, D), o (D, H d), their biases or None, and the q/k RMSNorm weights (d,) or None. Fused
    projections are split into views, so nothing is copied."""

    q: object
    k: object
    v: object
    o: object
    q_bias: object = None
    k_bias: object = None
    v_bias: object = None
    o_bias: object = None
    q_norm: object = None
    k_norm: object = None

    def proj(self, name: str):
        """(weight, bias) of projection ``name`` (q, k, v or o)."""
        return getattr(self, name), getattr(self, f"{name}_bias")


@dataclass(frozen=True)
class Family:
    name: str  # tcal's name for it (tests, the teacher table, docs): "llama", "gemma3"
    model_type: str  # transformers' config.model_type: "llama", "gemma3_text"
    title: str  # for people: "Llama", "Gemma 3"
    config_class: str  # transformers class names
    causal_lm_class: str
    attention: Attention = Attention()
    mlp: Mlp = Mlp()
    # the RMSNorms multiply by (1 + w): a q/k norm weight w is 1 + w in a GDN's HeadRMSNorm
    zero_centred_norms: bool = False
    # llama.cpp's general.architecture of a GGUF of this family (llama.cpp writes Mistral as llama); None: no GGUF
    gguf_architecture: str | None = None
    # tcal writes a plain teacher of this family in that architecture (tcal bench's teacher-llama.cpp row), with
    # llama.cpp's name of each layer tensor (transformers' name after model.layers.N.) and, where llama.cpp stores a
    # tensor otherwise than transformers, a hook (llama.cpp name, tensor, config) -> the tensor as it stores it (its
    # converter's modify_tensors: Llama's q/k rows in the pairwise RoPE order)
    teacher_gguf: bool = False
    gguf_layer_names: Mapping[str, str] = field(default_factory=lambda: dict(GGUF_LAYER_NAMES))
    gguf_tensor: Callable[[str, object, object], object] | None = None
    # how the GGUFs tcal writes hold its RoPE, a plain teacher's and a hybrid's (plain RoPE only unless it says more)
    gguf_rope: GGUFRope = PLAIN_ROPE
    # the Qwen3.5 layout holds its decoder layers (two norms per layer, a SiLU MLP, unscaled embeddings): the
    # qwen3_5 target and tcal export; the common rules (activation, MLP bias, sliding window: common_layout_blocker)
    # check a config's fields, and the family's own ``layout_rule`` (config, the layers kept as attention or None
    # where not known yet) -> why the layout cannot hold them (one line) or None, what only its module knows (layers
    # without RoPE, another attention)
    layout: bool = True
    layout_rule: Callable[[object, Sequence[int] | None], str | None] | None = None
    # the layers the family's tests keep as attention in its tiny model (tests/helpers.py): its special layers among
    # them (a layer without RoPE, a global layer between sliding ones), so that the kept layers' mapping is tested
    tiny_keep: tuple[int, ...] = (0, 2)
    fast_decoder: bool = True  # tcal.models.fast.FastDecoder runs it (tested)
    # the model_type of a vision-language checkpoint whose text decoder is a model of this family
    vision_language: str | None = None
    # the Split regex its tokenizer.json puts before a ByteLevel step -> llama.cpp's pre-tokenizer name
    pre_tokenizers: dict[str, str] = field(default_factory=dict)
    # real models of it by name: their public config fields (model_type aside), for runs that need a model's shape
    # but not its weights (tcal.models.shapes, tcal bench --model)
    shapes: Mapping[str, dict] = field(default_factory=dict)
    # config fields of a small random model from common sizes (vocab_size, hidden_size, ...): what it needs on top
    tiny: Callable[[dict], dict] = dict

    def __repr__(self) -> str:
        return f"Family({self.name!r})"

    def config(self, **fields):
        """A transformers config of this family."""
        import transformers

        return getattr(transformers, self.config_class)(**fields)

    def causal_lm(self, config):
        """A randomly initialised causal LM of this family from ``config``."""
        import transformers

        return getattr(transformers, self.causal_lm_class)(config)

    def attention_weights(self, attn) -> AttentionWeights:
        """The tensors of a teacher attention module of this family under q/k/v/o names."""
        a = self.attention
        if a.qkv is None:
            lin = {n: getattr(attn, getattr(a, n)) for n in "qkvo"}
            tensors = {n: lin[n].weight for n in "qkvo"} | {f"{n}_bias": lin[n].bias for n in "qkvo"}
        else:
            fused = getattr(attn, a.qkv)
            q_rows = attn.config.num_attention_heads * attn.head_dim
            kv_rows = (fused.weight.shape[0] - q_rows) // 2
            cut = (q_rows, q_rows + kv_rows)
            out = getattr(attn, a.o)
            tensors = {"o": out.weight, "o_bias": out.bias}
            for n, lo, hi in (("q", 0, cut[0]), ("k", cut[0], cut[1]), ("v", cut[1], None)):
                tensors[n] = fused.weight[lo:hi]
                tensors[f"{n}_bias"] = fused.bias[lo:hi] if fused.bias is not None else None
        for n in ("q_norm", "k_norm"):
            norm = getattr(attn, getattr(a, n), None)
            tensors[n] = norm.weight if norm is not None else None
        return AttentionWeights(**tensors)

    def output_projection(self, attn):
        """The attention module's output projection: its input is the per-head context (B, T, H d)."""
        return getattr(attn, self.attention.o)

    def gguf_name(self, name: str) -> str | None:
        """llama.cpp's name of a plain teacher's tensor (transformers' ``name``) in this family's architecture, or
        None where that architecture has no such tensor."""
        if name in GGUF_TOP_NAMES:
            return GGUF_TOP_NAMES[name]
        parts = name.split(".", 3)
        if parts[:2] == ["model", "layers"] and len(parts) == 4 and parts[3] in self.gguf_layer_names:
            return f"blk.{parts[2]}.{self.gguf_layer_names[parts[3]]}"
        return None

    def gguf_stored(self, gguf_name: str, tensor, config):
        """A teacher tensor as llama.cpp stores it under ``gguf_name`` (the family's hook, if it has one)."""
        return tensor if self.gguf_tensor is None else self.gguf_tensor(gguf_name, tensor, config)

    def layout_blocker(self, config, attention: Sequence[int] | None = None) -> str | None:
        """Why the Qwen3.5 layout cannot hold a hybrid of this family's ``config`` keeping ``attention`` as attention
        layers (None: any layers), in one line, or None: the family's ``layout``, the common rules, then its own
        ``layout_rule``."""
        if not self.layout:
            return _not_layout(self)
        return common_layout_blocker(config) or (self.layout_rule(config, attention) if self.layout_rule else None)

    def gguf_rope_blocker(self, config, arch: str) -> str | None:
        """Why a GGUF of llama.cpp's architecture ``arch`` cannot hold the RoPE of ``config`` (one line), or None."""
        return self.gguf_rope.blocker(rope_parameters(config), arch)

    def split_fused(self, name: str, tensor) -> list[tuple[str, object]]:
        """A state-dict entry under the separate MLP projections' names: a fused ``gate_up`` tensor becomes its gate
        and up halves (views, named like Llama's), anything else is returned as it is."""
        fused = self.mlp.gate_up
        if fused is None or f".mlp.{fused}." not in name:
            return [(name, tensor)]
        half = tensor.shape[0] // 2
        return [(name.replace(f".{fused}.", f".{LLAMA_MLP.gate}."), tensor[:half]),
                (name.replace(f".{fused}.", f".{LLAMA_MLP.up}."), tensor[half:])]


def _not_layout(fam: Family) -> str:
    # the families it does hold are named where the registry is known (tcal.conversion.target.layout_blocker)
    return (f"the teacher is a {fam.model_type!r} model; the Qwen3.5 layout holds no {fam.model_type} decoder layers "
            "(it needs two norms per layer, a SiLU MLP, unscaled embeddings)")


def common_layout_blocker(config) -> str | None:
    """What keeps the Qwen3.5 layout from any model of ``config`` whatever its family (one line), or None: the
    layout's MLP and GDN conv both take ``hidden_act`` (SiLU), its MLP has no bias and its attention no sliding
    window."""
    act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None) or "silu"
    if act != "silu":
        return f"the teacher's activation is {act!r}; the Qwen3.5 layout uses SiLU in its MLP and GDN layers"
    if getattr(config, "mlp_bias", False):
        return "the teacher's MLP has biases (mlp_bias=True); the Qwen3.5 layout's MLP has none"
    window = getattr(config, "sliding_window", None)
    limit = getattr(config, "max_position_embeddings", None)
    # a window as long as the model's positions never slides
    windowed = window is not None and getattr(config, "use_sliding_window", True) and not (limit and window >= limit)
    if windowed or "sliding_attention" in (getattr(config, "layer_types", None) or []):
        return (f"the teacher's attention uses a sliding window ({window} tokens); the Qwen3.5 layout has none "
                "(set sliding_window to null in the teacher's config.json if the model works without it)")
    return None


LLAMA_MLP = Mlp()  # the separate projections' names, which the Qwen3.5 layout and llama.cpp's writers map from
