"""Greedy generation of a model as tcal loads it (transformers with tcal's classes): the ``tcal`` engine's
:class:`~tcal.engines.engine.Generator`, and what retrieval and the instruct data generate with. Batched,
left-padded, cached, and a row of a batch stops as soon as its continuation is done by the caller's test (an answer
found, a stop sequence written), so that no row pays for its batch's longest answer more than it must."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from tqdm.auto import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList

from tcal.engines.engine import Generator
from tcal.utils.runtime import model_device

# done(i, text) -> whether prompt i's continuation ``text`` (decoded, special tokens dropped) is complete
Done = Callable[[int, str], bool]


class RowsDone(StoppingCriteria):
    """Stops each row of a batch once ``done`` holds for its continuation (rows ``first``.. of the prompts)."""

    def __init__(self, tokenizer, start: int, first: int, done: Done):
        self.tokenizer, self.start, self.first, self.done = tokenizer, start, first, done

    def __call__(self, input_ids: torch.Tensor, scores=None, **kwargs) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.start:], skip_special_tokens=True)
        return torch.tensor([self.done(self.first + r, t) for r, t in enumerate(texts)], device=input_ids.device)


class StepBar(StoppingCriteria):
    """Moves a progress bar by one generated token per step (never stops a row): a CPU batch can take minutes."""

    def __init__(self, bar):
        self.bar = bar

    def __call__(self, input_ids: torch.Tensor, scores=None, **kwargs) -> torch.Tensor:
        self.bar.update(1)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def left_padded(tokenizer, prompts: Sequence[str], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), both (B, T): ``prompts`` tokenised and padded on the left to the longest."""
    enc = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    width = max(len(e) for e in enc)
    ids = torch.full((len(enc), width), pad, dtype=torch.long)
    mask = torch.zeros((len(enc), width), dtype=torch.long)
    for r, e in enumerate(enc):
        ids[r, width - len(e):] = torch.tensor(e)
        mask[r, width - len(e):] = 1
    return ids, mask


@torch.no_grad()
def generate_greedy(model, tokenizer, prompts: Sequence[str], max_new_tokens: int, *, batch_size: int = 4,
                    progress: bool = False, desc: str = "generate", done: Done | None = None,
                    eos_token_id: int | list[int] | None = None) -> list[str]:
    """Greedy continuations of ``prompts`` (special tokens dropped), batched with left padding and a cache, in
    the prompts' order; with ``done`` a row stops once ``done(i, its continuation)`` holds. The tokenizer adds no
    special tokens: a prompt carries its own (a chat template's, a BOS the caller put in). ``eos_token_id``
    overrides the model's generation config (an instruct model's end-of-turn token)."""
    device = model_device(model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    outs = []
    was_training = model.training
    model.eval()
    extra = {} if eos_token_id is None else {"eos_token_id": eos_token_id}
    batches = range(0, len(prompts), batch_size)
    try:
        for k, s in enumerate(batches):
            ids, mask = left_padded(tokenizer, prompts[s:s + batch_size], pad)
            width = ids.shape[1]
            stop = StoppingCriteriaList([RowsDone(tokenizer, width, s, done)] if done is not None else [])
            bar = tqdm(total=max_new_tokens, desc=f"{desc} {k + 1}/{len(batches)}", unit="token", leave=False,
                       disable=not progress)
            stop.append(StepBar(bar))
            try:
                gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                     max_new_tokens=max_new_tokens, pad_token_id=pad, stopping_criteria=stop, **extra)
            finally:
                bar.close()
            outs += tokenizer.batch_decode(gen[:, width:], skip_special_tokens=True)
    finally:
        model.train(was_training)
    return outs


def end_of_turn(tokenizer) -> list[int] | None:
    """The ids that end an instruct model's answer: its EOS and, where the chat template has one, its
    end-of-turn token (``<|im_end|>``, ``<end_of_turn>``)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for tok in ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|endoftext|>"):
        i = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(i, int) and i >= 0 and i != tokenizer.unk_token_id:
            ids.add(i)
    return sorted(ids) or None


def default_batch_size(model) -> int:
    """Prompts generated together: 16 on a CPU (larger batches stop paying there), 128 on a GPU."""
    return 16 if model_device(model).type == "cpu" else 128


class TcalGenerator(Generator):
    """A model tcal loaded: prompts of similar length are generated together, ``batch_size`` at a time, each row
    stopping at its first stop sequence or the tokenizer's end of turn."""

    def __init__(self, model, tokenizer, batch_size: int):
        p = next(model.parameters())
        self.model, self.tokenizer, self.chunk = model, tokenizer, batch_size
        self.where = f"tcal (transformers), {str(p.dtype).removeprefix('torch.')} on {p.device}"

    def generate(self, prompts: Sequence[str], stops: Sequence[str], *, max_new_tokens: int, progress: bool = False,
                 desc: str = "generate") -> list[str]:
        tok = self.tokenizer
        order = sorted(range(len(prompts)), key=lambda i: len(tok(prompts[i], add_special_tokens=False)["input_ids"]))
        outs = generate_greedy(self.model, tok, [prompts[i] for i in order], max_new_tokens, batch_size=self.chunk,
                               progress=progress, desc=desc, done=lambda i, text: any(s in text for s in stops),
                               eos_token_id=end_of_turn(tok))
        result = [""] * len(prompts)
        for i, o in zip(order, outs):
            result[i] = o
        return result
