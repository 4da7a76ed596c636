"""The hybrid model in HF style: ``configuration_hybrid`` (HybridConfig) and ``modeling_hybrid``
(HybridForCausalLM). Importing ``tcal.models.modeling_hybrid`` registers both with transformers'
Auto classes; ``import tcal`` arranges that before transformers' Auto classes are first used.
"""
