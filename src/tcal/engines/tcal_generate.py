"""Greedy generation of a model as tcal loads it (transformers with tcal's classes): the ``tcal`` engine's
:class:`~tcal.engines.engine.Generator`, and what retrieval and the instruct data generate with. Batched,
left-padded, cached, and a row of a batch stops as soon as its continuation is done by the caller's test (an answer
found, a stop sequence written), so that no row pays for its batch's longest answer more than it must."""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from tqdm.auto import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList

from tcal.engines.engine import Generator
from tcal.utils.errors import TcalError
from tcal.utils.runtime import model_device

log = logging.getLogger(__name__)

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


def fast_path(model) -> bool:
    """Whether :func:`generate_greedy` decodes ``model`` on tcal's static cache (:class:`tcal.models.fast.FastDecoder`,
    a CUDA graph per decode step) by default: on CUDA, for the families it runs, in its dtypes; never where the
    environment says ``TCAL_FAST_GENERATE=0``."""
    import os

    from tcal.models.fast import SUPPORTED_DTYPES, runs

    if os.environ.get("TCAL_FAST_GENERATE", "1") in ("0", "false", "off"):
        return False

    try:
        p = next(model.parameters())
    except (StopIteration, AttributeError):
        return False
    return p.device.type == "cuda" and p.dtype in SUPPORTED_DTYPES and runs(getattr(model, "config", None)) is None


@torch.no_grad()
def generate_greedy(model, tokenizer, prompts: Sequence[str], max_new_tokens: int, *, batch_size: int = 4,
                    progress: bool = False, desc: str = "generate", done: Done | None = None,
                    eos_token_id: int | list[int] | None = None, fast: bool | None = None) -> list[str]:
    """Greedy continuations of ``prompts`` (special tokens dropped), batched with left padding and a cache, in
    the prompts' order; with ``done`` a row stops once ``done(i, its continuation)`` holds. The tokenizer adds no
    special tokens: a prompt carries its own (a chat template's, a BOS the caller put in). ``eos_token_id``
    overrides the model's generation config (an instruct model's end-of-turn token). ``fast``: decode on tcal's
    static cache (:func:`generate_fast`; default where :func:`fast_path` holds), else transformers' ``generate()``;
    both give the same text."""
    chosen = fast is None
    if fast is None:
        fast = fast_path(model)
    if fast:
        try:
            return generate_fast(model, tokenizer, prompts, max_new_tokens, batch_size=batch_size, progress=progress,
                                 desc=desc, done=done, eos_token_id=eos_token_id)
        except TcalError as e:  # chosen by default: generate() gives the same text, only slower
            if not chosen:
                raise
            log.warning("the static-cache decoder cannot run this model (%s); generating with generate()", e)
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


# generate_fast reads the rows' text every CHECK_EVERY steps to see which are done
CHECK_EVERY = 16


@torch.no_grad()
def generate_fast(model, tokenizer, prompts: Sequence[str], max_new_tokens: int, *, batch_size: int = 128,
                  progress: bool = False, desc: str = "generate", done: Done | None = None,
                  eos_token_id: int | list[int] | None = None, cuda_graphs: bool | None = None) -> list[str]:
    """:func:`generate_greedy` on :class:`tcal.models.fast.FastDecoder`: each batch left-padded (padded slots are
    never attended to, and GDN layers leave their state alone at padded tokens), prefilled once, then one captured
    decode step per token on CUDA (eager elsewhere). Every ``CHECK_EVERY`` steps the rows' text is read: the batch
    ends once every row has written an end token or satisfies ``done``. Each row's text is then cut where
    ``generate()`` would have stopped it: after its first end token or at the first length where ``done`` holds,
    so the two give the same text."""
    from tcal.models.fast import FastDecoder

    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    device = model_device(model)
    eos_t = torch.tensor(eos or [-1], device=device)
    outs: list[str] = []
    was_training = model.training
    model.eval()
    batches = range(0, len(prompts), batch_size)
    try:
        for k, s in enumerate(batches):
            ids, mask = left_padded(tokenizer, prompts[s:s + batch_size], pad)
            B, width = ids.shape
            dec = FastDecoder(model, max_len=width + max_new_tokens, batch_size=B, cuda_graphs=cuda_graphs,
                              compile=False, prefill_graph_max=0)
            logits = dec.prefill(ids, mask if not bool(mask.all()) else None)
            c = dec.cache
            c.tok.copy_(logits.argmax(-1, keepdim=True))
            del logits
            toks = [c.tok.clone()]
            ended = torch.isin(toks[0], eos_t).view(-1)
            stop: list[int | None] = [None] * B  # tokens each row keeps, once known
            checked = 0
            bar = tqdm(total=max_new_tokens, desc=f"{desc} {k + 1}/{len(batches)}", unit="token", leave=False,
                       disable=not progress)
            bar.update(1)
            try:
                for n in range(1, max_new_tokens + 1):
                    last = n == max_new_tokens
                    if n % CHECK_EVERY == 0 or last or bool(ended.all()):
                        gen = torch.cat(toks, 1).cpu()
                        checked = _rows_stopped(tokenizer, gen, s, checked, stop, eos, done)
                        if all(x is not None for x in stop):
                            break
                    if last:
                        break
                    c.tok.copy_(toks[-1])
                    dec._step()  # writes its greedy token into c.tok
                    toks.append(c.tok.clone())
                    ended |= torch.isin(toks[-1], eos_t).view(-1)
                    bar.update(1)
            finally:
                bar.close()
            gen = torch.cat(toks, 1).cpu()
            outs += [tokenizer.decode(gen[r, :stop[r] if stop[r] is not None else gen.shape[1]],
                                      skip_special_tokens=True) for r in range(B)]
            del dec, c
    finally:
        model.train(was_training)
    return outs


def _rows_stopped(tokenizer, gen: torch.Tensor, first: int, checked: int, stop: list, eos: list[int],
                  done: Done | None) -> int:
    """Fill ``stop[r]`` (how many tokens row r keeps, as ``generate()`` would stop it: after its first end token, or
    at the first length where ``done`` holds) for the rows of ``gen`` (B, n) that are finished; rows were read
    up to ``checked`` tokens before. Returns n."""
    n = gen.shape[1]
    for r in range(gen.shape[0]):
        if stop[r] is not None:
            continue
        row = gen[r].tolist()
        end = next((i + 1 for i, t in enumerate(row) if t in eos), None)
        upto = end if end is not None else n
        if done is not None and done(first + r, tokenizer.decode(row[:upto], skip_special_tokens=True)):
            upto = next(m for m in range(checked + 1, upto + 1)
                        if m == upto or done(first + r, tokenizer.decode(row[:m], skip_special_tokens=True)))
            stop[r] = upto
        elif end is not None:
            stop[r] = end
    return n


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
    """Prompts generated together: 16 on a CPU (larger batches stop paying there), 192 on a GPU (HumanEval's 164
    prompts in one batch on the static cache)."""
    return 16 if model_device(model).type == "cpu" else 192


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
