"""Greedy generation of a GGUF in llama.cpp (``llama-cpp-python``), prompted the way tcal prompts a model: the
llama.cpp engine's :class:`~tcal.engines.engine.Generator`.

The GGUF is the whole model as llama.cpp users run it: weights, tokenizer and chat template. :class:`GGUFTemplate`
renders that chat template the way transformers renders a tokenizer's (the same Jinja settings), so a teacher's
GGUF and its dequantised transformers copy are given the very same prompt text; the text's special tokens are parsed
as such by llama.cpp's own tokenizer.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tcal.engines.engine import Generator
from tcal.utils.errors import TcalError


class GGUFTemplate:
    """The tokenizer facts a prompt needs, read from a GGUF: its chat template (rendered like transformers'
    ``apply_chat_template``), BOS and EOS text, and whether its tokenizer puts BOS before every text."""

    def __init__(self, metadata: dict, token_text):
        self.chat_template = metadata.get("tokenizer.chat_template") or None
        bos, eos = metadata.get("tokenizer.ggml.bos_token_id"), metadata.get("tokenizer.ggml.eos_token_id")
        self.bos_token = token_text(int(bos)) if bos not in (None, "") else None
        self.eos_token = token_text(int(eos)) if eos not in (None, "") else None
        self.adds_bos = str(metadata.get("tokenizer.ggml.add_bos_token", "false")).lower() == "true"

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False) -> str:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                add_generation_prompt=False)
        except jinja2.exceptions.TemplateError as e:
            raise TcalError(f"the GGUF's chat template does not render ({e}); use --prompt-style completion") from None


def open_gguf(path, *, n_ctx: int = 4096, threads: int | None = None, gpu_layers: int = 0):
    """(llama.cpp model, its :class:`GGUFTemplate`)."""
    from tcal.engines.llamacpp import load

    llm = load(path, n_ctx, purpose="--engine llama.cpp", threads=threads, gpu_layers=gpu_layers)

    def token_text(i: int) -> str:
        return llm.detokenize([i], special=True).decode("utf-8", "replace")

    return llm, GGUFTemplate(llm.metadata, token_text)


def generate_gguf(llm, prompts: Sequence[str], stops: Sequence[str], *, max_new_tokens: int,
                  progress: bool = False, desc: str = "generate (llama.cpp)") -> list[str]:
    """Greedy continuations of ``prompts`` (text with its special tokens written out), one at a time, each cut by
    llama.cpp at the first of ``stops`` or an end-of-generation token."""
    from tqdm.auto import tqdm

    outs = []
    for p in tqdm(prompts, desc=desc, disable=not progress, unit="prompt", leave=False):
        ids = llm.tokenize(p.encode("utf-8"), add_bos=False, special=True)
        room = min(max_new_tokens, llm.n_ctx() - len(ids))
        if room < 1:
            raise TcalError(f"a prompt of {len(ids)} tokens leaves no room in llama.cpp's {llm.n_ctx()}-token context")
        r = llm.create_completion(prompt=ids, max_tokens=room, temperature=0.0, top_k=1, stop=list(stops))
        outs.append(r["choices"][0]["text"])
    return outs


class LlamaCppGenerator(Generator):
    """A GGUF opened in llama.cpp: prompts one at a time (llama.cpp batches a prompt's tokens, not prompts)."""

    chunk = 8

    def __init__(self, llm, template: GGUFTemplate, where: str):
        self.llm, self.tokenizer, self.where = llm, template, where

    @classmethod
    def open(cls, path, *, threads: int | None = None, gpu_layers: int = 0) -> LlamaCppGenerator:
        llm, template = open_gguf(path, threads=threads, gpu_layers=gpu_layers)
        return cls(llm, template, f"llama.cpp (llama-cpp-python), {Path(path).name}")

    def generate(self, prompts: Sequence[str], stops: Sequence[str], *, max_new_tokens: int, progress: bool = False,
                 desc: str = "generate") -> list[str]:
        return generate_gguf(self.llm, prompts, stops, max_new_tokens=max_new_tokens, progress=progress,
                             desc=f"{desc} (llama.cpp)")

    def close(self) -> None:
        self.llm.close()
