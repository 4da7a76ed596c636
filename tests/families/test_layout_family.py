"""docs/extending.md, *Adding a teacher family*, a family whose layers the Qwen3.5 layout cannot all hold, followed:
the page's SmolLM3-style module (every fourth layer without RoPE), written into a package directory of its own, is
found by the registry; its rule refuses the layout where a layer without RoPE is kept as attention (the export would
otherwise differ from the hybrid), and lets it be where only layers with RoPE are kept."""
import re
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_close, tiny_keep, tiny_teacher

import tcal
from tcal import families
from tcal.utils.errors import TcalError

ROOT = Path(__file__).resolve().parents[2]


def page_module() -> str:
    page = (ROOT / "docs" / "extending.md").read_text()
    section = page[page.index("## Adding a teacher family"):]
    return re.search(r"```python\n# tcal/families/smollm3\.py\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def smollm3(tmp_path, monkeypatch):
    """The registry as the package finds it with the page's module beside tcal's own."""
    pkg = tmp_path / "more_families"
    pkg.mkdir()
    (pkg / "smollm3.py").write_text(page_module())
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(pkg)])
    monkeypatch.delitem(sys.modules, "tcal.families.smollm3", raising=False)
    found = families._discover()
    monkeypatch.setitem(families.FAMILIES, "smollm3", found["smollm3"])
    monkeypatch.delitem(sys.modules, "tcal.families.smollm3", raising=False)
    return found["smollm3"]


def test_a_kept_layer_without_rope_is_refused_by_the_familys_rule(smollm3):
    from tcal.export.qwen3_5 import check_layout

    assert families.get("smollm3") is smollm3 and tiny_keep("smollm3") == [0, 3]
    teacher = tiny_teacher("smollm3")
    assert teacher.config.no_rope_layers == [1, 1, 1, 0]  # the tiny model's layer 3 attends without RoPE
    with pytest.raises(TcalError, match="--target qwen3_5: layer 3 attends without RoPE"):
        tcal.convert(teacher, keep=tiny_keep("smollm3"), init="copy", target="qwen3_5")
    native = tcal.convert(teacher, keep=tiny_keep("smollm3"), init="copy")  # --target auto
    assert native.config.target == "native"
    with pytest.raises(TcalError, match="layer 3 attends without RoPE"):
        check_layout(native)


def test_kept_layers_with_rope_export_with_the_hybrids_logits(smollm3):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from tcal.export.qwen3_5 import to_qwen3_5

    teacher = tiny_teacher("smollm3")
    hybrid = tcal.convert(teacher, keep=[0, 2], init="copy")
    assert hybrid.config.target == "qwen3_5"
    layout = to_qwen3_5(hybrid)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**layout.config)).eval()
    model.load_state_dict(layout.state_dict, strict=False)
    x = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(model(input_ids=x).logits, hybrid(input_ids=x).logits, 1e-5, "smollm3 layout logits")
