"""The family registry: every module of tcal.families holding a FAMILY is found, each fact is asked of it once, and
the GGUF architecture a family is written in is the one it is read back as."""
import pytest
from helpers import FAMILIES, tiny_teacher

from tcal import families
from tcal.utils.errors import TcalError


def test_every_family_module_is_found_and_named_once():
    import pkgutil

    modules = {m.name for m in pkgutil.iter_modules(families.__path__)} - {"family", "rope"}
    assert set(families.FAMILIES) == modules  # one family per module, the module named after it
    types = [f.model_type for f in families.FAMILIES.values()]
    assert len(set(types)) == len(types)
    assert FAMILIES == [f.name for f in families.FAMILIES.values() if f.layout]


@pytest.mark.parametrize("fam", families.FAMILIES.values(), ids=str)
def test_a_family_is_found_by_its_name_its_model_type_and_its_config(fam):
    teacher = tiny_teacher(fam.name, num_hidden_layers=2)
    assert type(teacher).__name__ == fam.causal_lm_class and teacher.config.model_type == fam.model_type
    assert families.get(fam.name) is families.get(fam.model_type) is families.of(teacher.config) is fam
    w = fam.attention_weights(teacher.model.layers[0].self_attn)
    cfg = teacher.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert w.q.shape == (cfg.num_attention_heads * d, cfg.hidden_size) and w.o.shape == (cfg.hidden_size, w.q.shape[0])
    assert w.k.shape == w.v.shape == (cfg.num_key_value_heads * d, cfg.hidden_size)
    if fam.gguf_architecture:
        assert fam in families.by_gguf_architecture(fam.gguf_architecture)


def test_unknown_families_are_one_line_errors():
    assert families.find("gpt2") is None
    with pytest.raises(TcalError, match="unsupported architecture 'gpt2'; tcal converts .*llama"):
        families.get("gpt2")
    # a vision-language checkpoint's type names the family of its text decoder
    assert families.find("gemma3") is families.get("gemma3_text")


def test_mistral_is_read_and_written_as_llama_cpp_llama():
    """llama.cpp has no mistral architecture: its converter writes Mistral as llama, tcal's teacher writer too, and
    a llama GGUF is read as a Llama or a Mistral."""
    mistral = families.get("mistral")
    assert mistral.gguf_architecture == "llama" and mistral.teacher_gguf
    assert families.by_gguf_architecture("llama") == [families.get("llama"), mistral]
    assert families.by_gguf_architecture("mistral") == []
