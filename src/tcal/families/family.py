"""What tcal knows of one teacher family, as plain data: a :class:`Family` per module of this package.

A family is a transformers ``model_type`` whose decoder tcal converts. Its entry names the transformers classes, how
its attention and MLP projections are stored (separate or fused), whether its RMSNorms multiply by ``w`` or by
``1 + w``, its llama.cpp architecture, whether the Qwen3.5 layout (``--target qwen3_5``, ``tcal export``) and
``FastDecoder`` hold it, its tokenizer's pre-tokenizer as llama.cpp names it, and the config of a small random model
of it (tests, examples). Everything tcal does with a teacher reads these facts here; nothing else names a family.

Torch is imported only by the functions that read a model's tensors, so ``import tcal`` and ``tcal --help`` stay
light.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


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
    # tcal writes a plain teacher of this family in that architecture (tcal bench's teacher-llama.cpp row)
    teacher_gguf: bool = False
    # the Qwen3.5 layout holds its decoder layers (two norms per layer, a SiLU MLP, unscaled embeddings): the
    # qwen3_5 target and tcal export; tcal.conversion.target checks the rest (activation, MLP bias, sliding window)
    layout: bool = True
    fast_decoder: bool = True  # tcal.models.fast.FastDecoder runs it (tested)
    # the model_type of a vision-language checkpoint whose text decoder is a model of this family
    vision_language: str | None = None
    # the Split regex its tokenizer.json puts before a ByteLevel step -> llama.cpp's pre-tokenizer name
    pre_tokenizers: dict[str, str] = field(default_factory=dict)
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

    def split_fused(self, name: str, tensor) -> list[tuple[str, object]]:
        """A state-dict entry under the separate MLP projections' names: a fused ``gate_up`` tensor becomes its gate
        and up halves (views, named like Llama's), anything else is returned as it is."""
        fused = self.mlp.gate_up
        if fused is None or f".mlp.{fused}." not in name:
            return [(name, tensor)]
        half = tensor.shape[0] // 2
        return [(name.replace(f".{fused}.", f".{LLAMA_MLP.gate}."), tensor[:half]),
                (name.replace(f".{fused}.", f".{LLAMA_MLP.up}."), tensor[half:])]


LLAMA_MLP = Mlp()  # the separate projections' names, which the Qwen3.5 layout and llama.cpp's writers map from
