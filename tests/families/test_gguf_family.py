"""docs/extending.md, *Adding a teacher family*, step 3, followed: the page's Mistral module, written into a package
directory of its own and found by the registry in place of tcal's, is all a family with GGUF behaviour takes. Its
teacher GGUF (named by the registry's defaults, its q/k rows reordered by its hook) runs in llama.cpp with the
teacher's logits; the same module without its hook writes a file llama.cpp runs as another model."""
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_close, tiny_teacher

from tcal import families

ROOT = Path(__file__).resolve().parents[2]


def page_module() -> str:
    page = (ROOT / "docs" / "extending.md").read_text()
    section = page[page.index("### 3. GGUF behaviour"):]
    return re.search(r"```python\n# tcal/families/mistral\.py\n(.*?)```", section, re.S).group(1)


def registered_from(tmp_path, monkeypatch, code: str):
    """The registry as the package finds it with ``code`` as its mistral module (tcal's own left out)."""
    pkg = tmp_path / "more_families"
    pkg.mkdir(exist_ok=True)
    (pkg / "mistral.py").write_text(code)
    found = [p for p in families.__path__ if Path(p).name == "families"]
    monkeypatch.setattr(families, "__path__", [str(pkg)])
    monkeypatch.delitem(sys.modules, "tcal.families.mistral")  # imported from the new directory, not the cache
    new = families._discover()
    monkeypatch.setattr(families, "__path__", found)
    monkeypatch.setitem(families.FAMILIES, "mistral", new["mistral"])
    return new["mistral"]


def llama_cpp_logits(path, ids):
    from tcal.engines.llamacpp import load

    llm = load(path, 128, logits_all=True, threads=1, kv_cache="f32")
    llm.eval(ids)
    out = torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))
    llm.close()
    return out


def test_the_pages_module_is_tcals():
    assert page_module() == (ROOT / "src" / "tcal" / "families" / "mistral.py").read_text()


def test_a_family_module_with_gguf_behaviour_is_all_it_takes(tmp_path, monkeypatch):
    from tcal.export.gguf import write_teacher_gguf

    ours = families.FAMILIES["mistral"]
    fam = registered_from(tmp_path, monkeypatch, page_module())
    assert fam is not ours and families.get("mistral") is fam and fam.gguf_tensor is not None
    teacher = tiny_teacher("mistral")
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        want = teacher(input_ids=torch.tensor([ids])).logits[0]
    types = write_teacher_gguf(teacher, tmp_path / "t.gguf", "f32")
    assert "blk.0.attn_q.weight" in types and "blk.3.ffn_norm.weight" in types  # the default llama.cpp names
    assert_close(llama_cpp_logits(tmp_path / "t.gguf", ids), want, 1e-5, "the page's family in llama.cpp")

    # the hook is what made it so: the module without it writes another model
    registered_from(tmp_path, monkeypatch, page_module().replace(", gguf_tensor=llama_cpp_rows", ""))
    assert families.get("mistral").gguf_tensor is None
    write_teacher_gguf(teacher, tmp_path / "plain.gguf", "f32")
    with pytest.raises(AssertionError, match="rel err"):  # 1e-6 with the hook, 1e-2 without on this tiny model
        assert_close(llama_cpp_logits(tmp_path / "plain.gguf", ids), want, 1e-4, "without the hook")
