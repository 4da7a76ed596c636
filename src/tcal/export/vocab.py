"""The tokenizer inside a GGUF: its ``tokenizer.*`` keys, from a GGUF that has them or from a transformers tokenizer.

A teacher that came as a GGUF keeps its own keys (copied as they are). A transformers tokenizer is written the
way llama.cpp reads a byte-level BPE: the tokens in id order, their types, the merges, the special-token ids,
and the name of llama.cpp's pre-tokenizer, recognised from the tokenizer's own pre-tokenizer (its structure, or the
Split regex a family's tokenizer publishes: ``Family.pre_tokenizers`` in :mod:`tcal.families`). A tokenizer of another kind is a one-line error that says what to pass
instead. Whatever the source, the export's check tokenises a probe text with llama.cpp and with the
tokenizer and compares the ids (:mod:`tcal.export.check`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tcal import families
from tcal.utils.errors import TcalError

# token types of llama.cpp's vocabulary
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4


@dataclass
class GGUFVocab:
    """``tokenizer.*`` keys: (key, value, GGUF value type name, array element type name or None)."""
    source: str  # where the keys came from, for the export's record
    keys: list[tuple[str, object, str, str | None]] = field(default_factory=list)


def from_gguf(path) -> GGUFVocab:
    """Every ``tokenizer.*`` key of an existing GGUF, as stored there."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as e:
        raise TcalError(f"cannot read the tokenizer of {path} ({e}); pass a readable .gguf") from None
    keys = []
    for name, f in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        main = f.types[0]
        sub = f.types[-1] if main == gguf.GGUFValueType.ARRAY else None
        if sub == gguf.GGUFValueType.STRING:
            value = [bytes(f.parts[i]) for i in f.data]  # raw bytes: a token need not be valid UTF-8
        elif main == gguf.GGUFValueType.STRING:
            value = bytes(f.parts[f.data[0]])
        else:
            value = f.contents()
        keys.append((name, value, main.name, sub.name if sub is not None else None))
    if not any(k[0] == "tokenizer.ggml.model" for k in keys):
        raise TcalError(f"{path} holds no tokenizer (no tokenizer.ggml.model); pass the GGUF of the teacher")
    return GGUFVocab(f"copied from {Path(path).name}", keys)


def pre_tokenizer_name(tokenizer_json: dict) -> str:
    """llama.cpp's name for a byte-level BPE tokenizer's pre-tokenizer; a TcalError for one it does not know."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        regex = (steps[0].get("pattern") or {}).get("Regex")
        # the families' tokenizers (Family.pre_tokenizers: Llama 3's, Qwen2's)
        known = {r: name for fam in families.FAMILIES.values() for r, name in fam.pre_tokenizers.items()}
        if regex in known:
            return known[regex]
    raise TcalError(f"the tokenizer's pre-tokenizer ({' + '.join(map(str, kinds))}) is not one tcal can name for "
                    "llama.cpp; pass --gguf-vocab with a GGUF of the teacher (llama.cpp's convert_hf_to_gguf.py "
                    "writes one) to copy its tokenizer")


def token_count(vocab: GGUFVocab) -> int | None:
    """How many tokens the keys list (None for a GGUF without a tokenizer)."""
    return next((len(v) for k, v, _, _ in vocab.keys if k == "tokenizer.ggml.tokens"), None)


def check_rows(vocab: GGUFVocab, rows: int) -> None:
    """llama.cpp sizes the embedding by the tokenizer: a GGUF whose token list and embedding rows differ does not
    load (or, from another model, would read the wrong rows). A one-line TcalError naming both sizes."""
    n = token_count(vocab)
    if n is not None and n != rows:
        raise TcalError(f"the tokenizer ({vocab.source}) has {n:,} tokens and the hybrid's embedding {rows:,} rows: "
                        "it is another model's tokenizer; pass --gguf-vocab with a GGUF of the hybrid's teacher")


def from_tokenizer(tok, vocab_size: int | None = None) -> GGUFVocab:
    """The keys llama.cpp reads for a byte-level BPE tokenizer, from a transformers fast tokenizer; the token list
    padded with unused placeholders up to ``vocab_size`` (the embedding's rows) where the model has more rows than
    the tokenizer has tokens (Qwen2.5's 151,936 rows for 151,665 tokens)."""
    backend = getattr(tok, "backend_tokenizer", None) or getattr(tok, "_tokenizer", None)
    if backend is None:
        raise TcalError("the hybrid's tokenizer is not a fast (tokenizers) tokenizer; pass --gguf-vocab with a GGUF "
                        "of the teacher")
    spec = json.loads(backend.to_str())
    model = spec.get("model", {})
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        kind = "SentencePiece-style BPE" if model.get("byte_fallback") else model.get("type")
        raise TcalError(f"the hybrid's tokenizer is a {kind} tokenizer; tcal writes byte-level BPE tokenizers into "
                        "a GGUF: pass --gguf-vocab with a GGUF of the teacher to copy its tokenizer")
    pre = pre_tokenizer_name(spec)
    vocab = dict(model["vocab"])
    added = {a["id"]: a for a in spec.get("added_tokens", [])}
    for i, a in added.items():
        vocab.setdefault(a["content"], i)
    size = max(max(vocab.values()) + 1, vocab_size or 0)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [USER_DEFINED] * size  # ids the vocabulary skips stay unused placeholders
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = NORMAL
    for i, a in added.items():
        types[i] = CONTROL if a.get("special") else USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    keys = [
        ("tokenizer.ggml.model", "gpt2", "STRING", None),
        ("tokenizer.ggml.pre", pre, "STRING", None),
        ("tokenizer.ggml.tokens", tokens, "ARRAY", "STRING"),
        ("tokenizer.ggml.token_type", types, "ARRAY", "INT32"),
        ("tokenizer.ggml.merges", merges, "ARRAY", "STRING"),
    ]
    for kind, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
                      ("pad", "padding_token_id")):
        tid = getattr(tok, f"{kind}_token_id", None)
        if isinstance(tid, int) and 0 <= tid < size:
            keys.append((f"tokenizer.ggml.{key}", tid, "UINT32", None))
    probe = tok("a", add_special_tokens=True)["input_ids"]
    adds_bos = bool(probe) and tok.bos_token_id is not None and probe[0] == tok.bos_token_id
    keys.append(("tokenizer.ggml.add_bos_token", adds_bos, "BOOL", None))
    keys.append(("tokenizer.ggml.add_space_prefix", False, "BOOL", None))
    template = getattr(tok, "chat_template", None)
    if isinstance(template, str) and template:
        keys.append(("tokenizer.chat_template", template, "STRING", None))
    return GGUFVocab(f"the hybrid's tokenizer (byte-level BPE, pre-tokenizer {pre})", keys)


def no_vocab() -> GGUFVocab:
    """A GGUF without a tokenizer (llama.cpp then reads token ids only): a hybrid saved without one."""
    return GGUFVocab("none (token ids only)", [("tokenizer.ggml.model", "none", "STRING", None)])
