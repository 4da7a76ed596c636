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


def test_fast_decoder_equals_eager_on_a_hybrid_of_the_real_teacher(teacher):
    """FastDecoder (static cache, packed projections; eager on CPU) == HF generate() on a hybrid
    converted from the real teacher: prefill logits within fp32 tolerance and 64 greedy tokens
    identical, for a left-padded batch of two real prompts."""
    from helpers import assert_close

    from tcal.models.fast import FastDecoder

    model, tok = teacher
    hybrid = tcal.convert(model, keep="uniform:50%", init="copy").eval()
    hybrid.generation_config.eos_token_id = None  # FastDecoder never stops early
    prompts = ["The river flows through the old town and", "In 1848 the assembly met in"]
    enc = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    width = max(len(e) for e in enc)
    ids = torch.full((2, width), tok.eos_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, e in enumerate(enc):
        ids[r, width - len(e):], mask[r, width - len(e):] = torch.tensor(e), 1
    with torch.no_grad():
        ref = hybrid.generate(ids, attention_mask=mask, max_new_tokens=64, do_sample=False,
                              pad_token_id=tok.eos_token_id)
        eager_logits = hybrid(input_ids=ids, attention_mask=mask).logits[:, -1]
    fast = FastDecoder(hybrid, max_len=width + 64, batch_size=2)
    # 1e-4: the packed prefill sums in another order (one GEMM for q/k/v/g/a/b, the conv as shifted products
    # in fp32), and 15 converted layers of a real model carry that rounding; bf16 would be ~1e-2
    assert_close(fast.prefill(ids, mask), eager_logits, 1e-4, "prefill logits, fast vs eager")
    fast = FastDecoder(hybrid, max_len=width + 64, batch_size=2)
    assert torch.equal(fast.generate(ids, max_new_tokens=64, attention_mask=mask), ref)


def test_the_real_hybrid_runs_in_transformers_without_tcal_and_in_llama_cpp(teacher, tmp_path):
    """A Qwen3.5-layout hybrid of the real teacher (Phase 1 calibrated), exported through the CLI: the same greedy
    continuations in tcal, in transformers in a process that cannot import tcal, and in llama.cpp (f32 GGUF with
    the teacher GGUF's own tokenizer)."""
    import json
    import subprocess
    import sys

    import numpy as np

    from tcal.cli import main
    from tcal.engines.llamacpp import load

    model, tok = teacher
    h = tmp_path / "hybrid"
    assert main(["convert", "--teacher", "smollm2-135m", "--keep", "uniform:50%", "--init", "phase1-exact",
                 "--calib-windows", "4", "--calib-window", "256", "--eval", "none", "--no-progress", "--out",
                 str(h)]) == 0
    assert main(["export", str(h), "--out", str(tmp_path / "hf")]) == 0
    assert main(["export", str(h), "--format", "gguf", "--gguf-type", "f32", "--no-progress", "--out",
                 str(tmp_path / "gguf")]) == 0
    rec = json.loads((tmp_path / "gguf" / "export.json").read_text())
    assert rec["tokenizer"].startswith("copied from SmolLM2") and rec["check"]["tokenizer"] == "same ids"
    hybrid = AutoModelForCausalLM.from_pretrained(h).eval()
    hybrid.generation_config.eos_token_id = None  # plain greedy argmax everywhere: no engine stops at EOS
    prompts = ["The river flows through the old town and", "In 1848 the assembly met in", "Photosynthesis is"]
    n = 16
    want = []
    for p in prompts:
        ids = tok(p, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            out = hybrid.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
        want.append(out[0, ids.shape[1]:].tolist())
    script = ("import sys, json; sys.modules['tcal'] = None\n"
              "import torch, transformers\n"
              "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
              "m.generation_config.eos_token_id = None\n"
              "t = transformers.AutoTokenizer.from_pretrained(sys.argv[1])\n"
              "out = []\n"
              "for p in json.loads(sys.argv[2]):\n"
              "    ids = t(p, return_tensors='pt', add_special_tokens=False).input_ids\n"
              f"    g = m.generate(ids, max_new_tokens={n}, do_sample=False, "
              "pad_token_id=t.eos_token_id)\n"
              "    out.append(g[0, ids.shape[1]:].tolist())\n"
              "print(json.dumps([type(m).__name__, out]))\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "hf"), json.dumps(prompts)], check=True,
                          capture_output=True, text=True)
    name, got = json.loads(done.stdout.strip().splitlines()[-1])
    assert name == "Qwen3_5ForCausalLM" and got == want
    llm = load(tmp_path / "gguf" / "model-f32.gguf", 128, logits_all=True, kv_cache="f32", threads=2)
    for p, w in zip(prompts, want):
        llm.reset()
        llm.eval(llm.tokenize(p.encode(), add_bos=False, special=False))
        got = []
        for _ in range(n):
            got.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([got[-1]])
        assert got == w, (p, got, w)
