"""Reload what an export wrote, with the engine that will run it, and compare it with the hybrid.

``--format hf`` reloads through transformers' own ``Qwen3_5ForCausalLM`` (and its tokenizer from the written files);
``--format gguf`` through llama.cpp (``llama-cpp-python``, the extra ``tcal[gguf]``). Either way a probe text is
tokenised by what was written and by the tokenizer the export took, and the ids compared. Logits are compared on
the probe's tokens by their relative error (||export - hybrid|| / ||hybrid||, fp32) and by how often the two pick
the same next token. An hf export is also run once in bfloat16, the dtype vLLM and SGLang serve it in, so that
the engine table can say how much that rounding costs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

PROBE_TEXT = ("The river rose through the night, and by morning the old bridge at Hexham was under water. "
              "In 1771 the flood took every bridge on the Tyne but one; 23 people died.")
# the largest relative logit error an export may show and still be the hybrid. f32 files differ from the
# hybrid by the order of float operations only; the others by their rounding of the weights. The 4-bit bounds are
# about twice what the real SmolLM2 hybrid shows (docs/results.md, *Serving layout*): a file that lost a tensor
# (the scaled q/k weights flushed to zero, say) is far past them.
TOLERANCE = {"f32": 1e-4, "float32": 1e-4, "bf16": 8e-2, "bfloat16": 8e-2, "f16": 3e-2, "q8_0": 8e-2,
             "q4_k_m": 0.25, "q4_0": 0.8}


@dataclass
class CheckResult:
    tokens: int
    rel_err: float
    top1_agree: float
    tolerance: float
    tokenizer: str  # "same ids", "differs at token i", or "not compared (...)"
    bf16_rel_err: float | None = None  # hf: the export computed in bfloat16 (transformers) against the hybrid
    bf16_top1_agree: float | None = None

    @property
    def ok(self) -> bool:
        return self.rel_err <= self.tolerance and not self.tokenizer.startswith("differs")


def probe_ids(tokenizer, vocab_size: int, n: int = 48) -> torch.Tensor:
    """(1, T) token ids: the probe text's, or fixed pseudo-random ids for a hybrid without a tokenizer."""
    if tokenizer is not None:
        ids = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"][:n]
        return torch.tensor([ids])
    return torch.randint(0, vocab_size, (1, n), generator=torch.Generator().manual_seed(0))


def compare(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(relative error, share of positions with the same argmax) of two (T, V) logit tensors."""
    a, e = actual.double(), expected.double()
    rel = float((a - e).norm() / e.norm().clamp_min(1e-30))
    return rel, float((a.argmax(-1) == e.argmax(-1)).double().mean())


@torch.no_grad()
def hf_logits(path, ids: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """(T, V) logits (as fp32) of the exported transformers checkpoint computed in ``dtype``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    return model(input_ids=ids).logits[0].float()


def _first_difference(got: list[int], want: list[int], engine: str, source: str) -> str:
    if got == want:
        return "same ids"
    i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return f"differs at token {i} ({engine} {got[i:i + 4]}, {source} {want[i:i + 4]})"


def hf_tokenizer_check(path, tokenizer) -> str:
    """Does the tokenizer saved in the export tokenise the probe text as the tokenizer the export took?"""
    if tokenizer is None:
        return "not compared (no tokenizer)"
    from transformers import AutoTokenizer

    try:
        written = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # a tokenizer that does not load from the written files is the check failing
        return f"differs: the written tokenizer does not load ({type(e).__name__})"
    got = written(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    return _first_difference(got, tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"], "the export's",
                             "the source tokenizer's")


CHECK_NEEDS = "checking a GGUF needs llama-cpp-python: pip install 'tcal[gguf]' (or pass --no-check)"


def load_gguf(path, n_ctx: int, *, vocab_only: bool = False, logits_all: bool = True):
    """llama.cpp on ``path`` with an f32 KV cache: the check compares the model, and llama.cpp's default f16 cache
    would round every cached key and value (a 5e-4 relative logit error on its own)."""
    from tcal.engines import llamacpp

    return llamacpp.load(path, n_ctx, purpose="checking a GGUF (--no-check skips it)",
                         threads=max(1, min(8, os.cpu_count() or 1)), kv_cache="f32", logits_all=logits_all,
                         vocab_only=vocab_only)


def gguf_logits(path, ids: torch.Tensor) -> torch.Tensor:
    """(T, V) logits llama.cpp computes for the GGUF at ``path`` on ``ids`` (1, T)."""
    import numpy as np

    T = ids.shape[1]
    llm = load_gguf(path, n_ctx=max(64, T))
    llm.eval(ids[0].tolist())
    out = torch.from_numpy(np.array(llm.scores[:T], dtype=np.float32))
    llm.close()
    return out


def gguf_tokenizer_check(path, tokenizer) -> str:
    """Does llama.cpp tokenise the probe text as the hybrid's tokenizer does?"""
    if tokenizer is None:
        return "not compared (the hybrid has no tokenizer)"
    llm = load_gguf(path, n_ctx=64, vocab_only=True, logits_all=False)
    got = llm.tokenize(PROBE_TEXT.encode(), add_bos=False, special=False)
    llm.close()
    want = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    return _first_difference(got, want, "llama.cpp", "the hybrid's tokenizer")


@torch.no_grad()
def check_export(hybrid, tokenizer, fmt: str, path, kind: str) -> CheckResult:
    """Reload ``path`` (an hf directory or a .gguf), compare with ``hybrid`` (fp32) on the probe's tokens."""
    ids = probe_ids(tokenizer, hybrid.config.vocab_size)
    expected = hybrid.float()(input_ids=ids.to(next(hybrid.parameters()).device)).logits[0].float().cpu()
    bf16 = (None, None)
    if fmt == "hf":
        actual, tok_check = hf_logits(path, ids), hf_tokenizer_check(path, tokenizer)
        bf16 = compare(hf_logits(path, ids, torch.bfloat16), expected)
    else:
        actual, tok_check = gguf_logits(path, ids), gguf_tokenizer_check(path, tokenizer)
    rel, agree = compare(actual, expected)
    return CheckResult(ids.shape[1], rel, agree, TOLERANCE[kind], tok_check, *bf16)
