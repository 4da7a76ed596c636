"""End to end on the real offline teacher (SmolLM2-135M) and the packaged Wikipedia text."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import tcal
from tcal.taylor.phase2 import AlignConfig

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def teacher():
    return tcal.load_teacher("smollm2-135m")


def test_taylor_beats_copy_zero_shot_and_checkpoint_roundtrips(teacher, tmp_path):
    model, tok = teacher
    keep = [i for i in range(30) if i not in (5, 20)]
    calib = tcal.token_windows("wiki:calib", tok, window=256, n_windows=4)
    copy = tcal.convert(model, keep=keep, init="copy")
    taylor = tcal.convert(model, keep=keep, init="taylor-exact-silent", calib_ids=calib,
                          align=AlignConfig(steps=60))
    ppl = {name: tcal.perplexity(m, tok, "wiki:eval", window=256, windows=4, progress=False)
           for name, m in (("teacher", model), ("copy", copy), ("taylor", taylor))}
    assert ppl["teacher"] < ppl["taylor"] < ppl["copy"], ppl
    taylor.save_pretrained(tmp_path / "h")
    tok.save_pretrained(tmp_path / "h")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "h").eval()
    ids = tok("The river flows through the old town", return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(reloaded(**ids).logits, taylor.eval()(**ids).logits)
        out = reloaded.generate(**ids, max_new_tokens=8, do_sample=False)
        assert torch.equal(out, reloaded.generate(**ids, max_new_tokens=8, do_sample=False, use_cache=False))
