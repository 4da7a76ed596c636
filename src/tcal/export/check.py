"""Reload what an export wrote, with the engine that will run it, and compare it with the hybrid.

``--format hf`` reloads through transformers' own ``Qwen3_5ForCausalLM``; ``--format gguf`` through llama.cpp
(``llama-cpp-python``, the extra ``tcal[gguf]``), which also tokenises a probe text so that the GGUF's
tokenizer is compared with the hybrid's. Logits are compared on the probe's tokens by their relative error
(||export - hybrid|| / ||hybrid||, fp32) and by how often the two pick the same next token.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tcal.utils.errors import TcalError

PROBE_TEXT = ("The river rose through the night, and by morning the old bridge at Hexham was under water. "
              "In 1771 the flood took every bridge on the Tyne but one; 23 people died.")
# the largest relative logit error an export may show and still be the hybrid. f32 files differ from the
# hybrid by the order of float operations only; the others by their rounding of the weights.
TOLERANCE = {"f32": 1e-4, "float32": 1e-4, "bf16": 8e-2, "bfloat16": 8e-2, "f16": 3e-2, "q8_0": 8e-2}


@dataclass
class CheckResult:
    tokens: int
    rel_err: float
    top1_agree: float
    tolerance: float
    tokenizer: str  # "same ids", "differs at token i", or "not compared (...)"

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
def hf_logits(path, ids: torch.Tensor) -> torch.Tensor:
    """(T, V) fp32 logits of the exported transformers checkpoint."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return model(input_ids=ids).logits[0].float()


def llama_cpp():
    try:
        import llama_cpp as lc
    except ImportError:
        raise TcalError("checking a GGUF needs llama-cpp-python: pip install 'tcal[gguf]' (or pass --no-check)") from None
    return lc


F32 = 0  # ggml's type id of float32


def load_gguf(path, n_ctx: int, *, vocab_only: bool = False, logits_all: bool = True):
    """llama.cpp on ``path`` with an f32 KV cache: the check compares the model, and llama.cpp's default f16 cache
    would round every cached key and value (a 5e-4 relative logit error on its own)."""
    lc = llama_cpp()
    threads = max(1, min(8, os.cpu_count() or 1))
    try:
        return lc.Llama(model_path=str(path), n_ctx=n_ctx, logits_all=logits_all, vocab_only=vocab_only,
                        n_threads=threads, n_threads_batch=threads, type_k=F32, type_v=F32, verbose=False)
    except (ValueError, RuntimeError) as e:
        raise TcalError(f"llama.cpp cannot load {path} ({e}); llama-cpp-python {lc.__version__} may predate the "
                        "qwen35 architecture: pip install -U 'tcal[gguf]'") from None


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
    if got == want:
        return "same ids"
    i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return f"differs at token {i} (llama.cpp {got[i:i + 4]}, the hybrid's tokenizer {want[i:i + 4]})"


@torch.no_grad()
def check_export(hybrid, tokenizer, fmt: str, path, kind: str) -> CheckResult:
    """Reload ``path`` (an hf directory or a .gguf), compare with ``hybrid`` (fp32) on the probe's tokens."""
    ids = probe_ids(tokenizer, hybrid.config.vocab_size)
    expected = hybrid.float()(input_ids=ids.to(next(hybrid.parameters()).device)).logits[0].float().cpu()
    if fmt == "hf":
        actual, tok_check = hf_logits(path, ids), "not compared (the export carries the hybrid's own tokenizer files)"
    else:
        actual, tok_check = gguf_logits(path, ids), gguf_tokenizer_check(path, tokenizer)
    rel, agree = compare(actual, expected)
    return CheckResult(ids.shape[1], rel, agree, TOLERANCE[kind], tok_check)
