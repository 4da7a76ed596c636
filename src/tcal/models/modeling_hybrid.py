"""The hybrid model: the teacher's own HF architecture with GDN layers swapped in.

The teacher's modeling code builds the embeddings, decoder layers, norms and MLPs (its class is
rebuilt from ``HybridConfig.base_config``); the converted layers' ``self_attn`` is a
:class:`~tcal.modules.gdn.GatedDeltaNet`. Nothing is vendored, and state-dict keys are the
teacher's (``model.layers.3.self_attn.q_proj.weight``...). Importing this module registers the
class with ``AutoModelForCausalLM``, so a saved hybrid loads without ``trust_remote_code``.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from transformers import AutoModel, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from tcal.models.configuration_hybrid import HybridConfig
from tcal.modules.gdn import GatedDeltaNet
from tcal.utils import compat
from tcal.utils.atomic import atomic_dir
from tcal.utils.errors import TcalError


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
        # from_config would build the teacher's modules in the dtype its saved config names (the teacher's, often
        # float32) while the GDN layers follow the default dtype that from_pretrained(dtype=...) sets: one dtype
        self.model = AutoModel.from_config(config.teacher_config(), dtype=torch.get_default_dtype())
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
        with atomic_dir(save_directory, theirs="replace") as tmp:  # as transformers: same names replaced
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


AutoModelForCausalLM.register(HybridConfig, HybridForCausalLM, exist_ok=True)
compat.install_cache_redirect()
