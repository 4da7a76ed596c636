"""Configuration of a tcal hybrid: the teacher's config plus which layers are Gated DeltaNet.

The teacher's own ``config.to_dict()`` travels inside ``base_config``; ``layer_types`` says per
layer ``"full_attention"`` (kept softmax attention) or ``"linear_attention"`` (GDN), the
convention transformers' hybrid models use. Importing this module registers ``tcal_hybrid``
with ``AutoConfig``.
"""
from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import AutoConfig, PreTrainedConfig

from tcal.modules.gdn_shape import GDN_OPTIONS, GDNShape

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
    target: str = "native"  # the layout the hybrid was built to fit (tcal.conversion.target)
    # gdn_<name> for every GDNShape option, with its default: the options are declared once, in
    # tcal.modules.gdn_shape, and a saved config.json holds them flat, as hybrids always have
    for _option in GDN_OPTIONS:
        __annotations__[f"gdn_{_option.name}"] = _option.type
        locals()[f"gdn_{_option.name}"] = _option.default
    del _option
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
        return GDNShape(hidden_size=self.hidden_size, num_heads=self.num_attention_heads, head_dim=self.head_dim,
                        **{f.name: getattr(self, f"gdn_{f.name}") for f in GDN_OPTIONS})


AutoConfig.register(HybridConfig.model_type, HybridConfig, exist_ok=True)
