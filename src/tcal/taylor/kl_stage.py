"""An optional last calibration stage: a short whole-model KL fit of every GDN layer at once.

Phase 2 fits each layer to its own target, so the small errors of 15-22 converted layers add
up in the residual stream and nothing ever sees their sum. This stage trains the GDN layers
(only them: embeddings, MLPs, norms and the kept attention stay the teacher's) jointly on the
forward KL(teacher || hybrid) of the next-token distributions over the calibration training
sequences. The state kept is the one of lowest KL on the held-out calibration sequences, which
are evaluated before the first step too, so the stage can never return a worse model than it
was given (on those sequences).
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from tcal.data.recall import recall_rows
from tcal.modules.distill_loss import chunked_distill_loss, final_hidden, lm_parts
from tcal.taylor.capture import eager_attention, hooks
from tcal.taylor.phase2 import lr_factor
from tcal.utils.errors import TcalError
from tcal.utils.runtime import memory_budget

log = logging.getLogger(__name__)


@dataclass
class KLConfig:
    steps: int = 0  # 0 = no KL stage
    lr: float = 3e-4  # AdamW, every GDN parameter
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    batch_size: int = 4  # training sequences per step
    eval_every: int = 5  # held-out KL every n steps (and at the last step)
    # stop after this many held-out evaluations without a new best, and never before a tenth of the run
    # (patience_frac): late in a long run the held-out KL still falls, slowly and with plateaus, and a fixed
    # few checks cut a long stage off mid-descent (README, *Budget*)
    patience: int | None = 4
    patience_frac: float = 0.1
    schedule: str = "cosine"
    warmup_steps: int = 0
    seed: int = 0
    # keep the frozen teacher's final hidden states of the held-out and training sequences instead of
    # a teacher forward per step and per evaluation, as far as they fit runtime.memory_budget
    cache_teacher: bool = True
    tf32: bool | None = None  # TF32 matrix products on CUDA (None or True; False: full fp32)
    # Weight of an extra term: the relative MSE between the hybrid's and the teacher's residual streams
    # entering each kept attention layer (0 = off). The logits' KL hardly sees whether a kept retrieval head
    # still finds a distant token; this term asks for the inputs those heads were trained on. With it the
    # teacher runs every step (its intermediate states are not cached).
    attn_input_weight: float = 0.0
    # Weight of an extra term: KL(teacher || hybrid) of the attention distributions of the kept attention
    # layers (every head and query position; eager attention in both models; 0 = off).
    attn_map_weight: float = 0.0
    # Weight of an extra term: the relative MSE between the hybrid's and the teacher's queries of the kept attention
    # layers (q_proj of the normed residual stream, every position). Patching the teacher's stream into the hybrid
    # at the question's last token alone gives a kept retrieval head back its attention on a distant needle; at the
    # needle's tokens it does not (bench/needle_patch.py): the query, not the key, is what the hybrid breaks.
    attn_query_weight: float = 0.0
    # The recall mix on the stage's sequences (tcal.data.recall; 0 = off): this share of the training and held-out
    # calibration sequences ends with a copy of an earlier recall_span-token span of itself, so the KL, and the
    # held-out KL that picks the state kept, also ask for copying from far back in the context.
    recall_frac: float = 0.0
    recall_span: int = 256

    def __post_init__(self):
        if self.steps < 0:
            raise TcalError(f"KL stage steps must be >= 0, got {self.steps}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise TcalError(f"KL stage lr must be a finite number > 0, got {self.lr!r}")
        if self.batch_size < 1 or self.eval_every < 1:
            raise TcalError("KL stage batch_size and eval_every must be >= 1")
        if self.patience is not None and self.patience < 1:
            raise TcalError(f"KL stage patience must be >= 1 evaluations (or None), got {self.patience}")
        if not (isinstance(self.patience_frac, (int, float)) and 0 <= self.patience_frac <= 1):
            raise TcalError(f"KL stage patience_frac must be a share of the run in [0, 1], got {self.patience_frac!r}")
        if not (isinstance(self.recall_frac, (int, float)) and 0 <= self.recall_frac <= 1):
            raise TcalError(f"KL stage recall_frac must be a share in [0, 1], got {self.recall_frac!r}")
        if self.recall_span < 1:
            raise TcalError(f"KL stage recall_span must be >= 1 tokens, got {self.recall_span}")
        for name in ("attn_input_weight", "attn_map_weight", "attn_query_weight"):
            w = getattr(self, name)
            if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
                raise TcalError(f"KL stage {name} must be a finite number >= 0, got {w!r}")

    def stale_limit(self) -> int | None:
        """Held-out evaluations without a new best that end the stage (None: it never stops early)."""
        if self.patience is None:
            return None
        return max(self.patience, math.ceil(self.patience_frac * self.steps / self.eval_every))


def _gdn_params(hybrid) -> list[torch.nn.Parameter]:
    return [p for gdn in hybrid.gdn_modules().values() for p in gdn.parameters()]


@torch.no_grad()
def teacher_hidden(base_t, ids: torch.Tensor, batch_size: int, device) -> torch.Tensor:
    """The final hidden states (after the final norm) of the teacher decoder ``base_t`` for ``ids`` (N, T):
    (N, T, D) on ``device``."""
    return torch.cat([final_hidden(base_t, ids[s : s + batch_size].to(device))
                      for s in range(0, ids.shape[0], batch_size)])


def _hidden_bytes(teacher, ids: torch.Tensor) -> int:
    p = next(teacher.parameters())
    return ids.numel() * teacher.config.hidden_size * p.element_size()


def kept_layer_terms(base_s, base_t, ids: torch.Tensor, layers, maps: bool = False, queries: bool = False):
    """One pass of each decoder over ``ids`` (the teacher without grad): (hybrid's final hidden states, teacher's,
    mean over ``layers`` of ||h_S - h_T||^2 / ||h_T||^2 for the residual streams entering them (hidden_states[i]
    is layer i's input), and with ``maps`` the mean over those layers, heads and query positions of
    KL(teacher || hybrid) of their attention distributions, else None; with ``queries`` the mean over those layers
    of ||q_S - q_T||^2 / ||q_T||^2 for their query projections of the normed streams, else None)."""
    probs: dict[str, dict[int, torch.Tensor]] = {"s": {}, "t": {}}
    handles = []
    if maps:
        for tag, base in (("s", base_s), ("t", base_t)):
            for i in layers:
                handles.append(base.layers[i].self_attn.register_forward_hook(
                    lambda _m, _a, res, tag=tag, i=i: probs[tag].__setitem__(i, res[1])))
    with hooks(handles), (eager_attention(base_s) if maps else contextlib.nullcontext()), \
            (eager_attention(base_t) if maps else contextlib.nullcontext()):
        out_s = base_s(input_ids=ids, use_cache=False, output_hidden_states=True)
        with torch.no_grad():
            out_t = base_t(input_ids=ids, use_cache=False, output_hidden_states=True)
    gaps = [(out_s.hidden_states[i].float() - out_t.hidden_states[i].float()).pow(2).sum()
            / out_t.hidden_states[i].float().pow(2).sum().clamp_min(1e-30) for i in layers]
    map_kl = None
    if maps:
        kls = []
        for i in layers:
            p_t, p_s = probs["t"][i].float(), probs["s"][i].float()  # (B, H, T, T), zero above the diagonal
            kls.append((torch.xlogy(p_t, p_t) - p_t * p_s.clamp_min(1e-30).log()).sum(-1).mean())
        map_kl = torch.stack(kls).mean()
    q_gap = None
    if queries:
        qs = []
        for i in layers:
            blk_s, blk_t = base_s.layers[i], base_t.layers[i]
            q_s = blk_s.self_attn.q_proj(blk_s.input_layernorm(out_s.hidden_states[i])).float()
            with torch.no_grad():
                q_t = blk_t.self_attn.q_proj(blk_t.input_layernorm(out_t.hidden_states[i])).float()
            qs.append((q_s - q_t).pow(2).sum() / q_t.pow(2).sum().clamp_min(1e-30))
        q_gap = torch.stack(qs).mean()
    return out_s.last_hidden_state, out_t.last_hidden_state, torch.stack(gaps).mean(), map_kl, q_gap


@torch.no_grad()
def mean_kl(hybrid, teacher, ids: torch.Tensor, batch_size: int, hidden: torch.Tensor | None = None) -> float:
    """Mean KL(teacher || hybrid) per predicted token over ``ids`` (N, T); ``hidden``: the teacher's
    ``teacher_hidden`` of the same ids, if kept."""
    base_s, head_s = lm_parts(hybrid)
    base_t, head_t = lm_parts(teacher)
    dev = head_s.weight.device
    total, n = 0.0, 0
    for s in range(0, ids.shape[0], batch_size):
        mb = ids[s : s + batch_size].to(dev)
        hs = final_hidden(base_s, mb)
        ht = hidden[s : s + batch_size] if hidden is not None else final_hidden(base_t, mb)
        _, kl, _ = chunked_distill_loss(hs.reshape(-1, hs.shape[-1]), head_s, ht.reshape(-1, ht.shape[-1]), head_t,
                                        use_checkpoint=False)
        total, n = total + kl * mb.numel(), n + mb.numel()
    return total / n


def kl_stage(hybrid, teacher, train_ids: torch.Tensor, heldout_ids: torch.Tensor, cfg: KLConfig,
             progress: bool = False) -> dict:
    """Train the GDN layers of ``hybrid`` on KL to ``teacher`` over ``train_ids`` (N, T), in place;
    keep the state of lowest KL on ``heldout_ids``. Returns the record (KL curve, best step, ...)."""
    if heldout_ids.shape[0] == 0:
        raise TcalError("the KL stage needs held-out calibration sequences to pick its state; "
                        "use a held-out fraction > 0")
    t0 = time.perf_counter()
    if cfg.recall_frac > 0:
        if train_ids.shape[1] < 2 * cfg.recall_span:
            raise TcalError(f"the KL stage's recall mix copies {cfg.recall_span}-token spans, which needs calibration "
                            f"windows of at least {2 * cfg.recall_span} tokens (they have {train_ids.shape[1]}); "
                            "lower the span or lengthen the windows")
        train_ids = recall_rows(train_ids, cfg.seed, cfg.recall_frac, cfg.recall_span)
        heldout_ids = recall_rows(heldout_ids, cfg.seed, cfg.recall_frac, cfg.recall_span,
                                  first_sample=train_ids.shape[0])
    params = _gdn_params(hybrid)
    saved_flags = {id(p): p.requires_grad for p in hybrid.parameters()}
    base_s, head_s = lm_parts(hybrid)
    base_t, head_t = lm_parts(teacher)
    dev = head_s.weight.device
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    was_training, teacher_training = hybrid.training, teacher.training
    teacher.eval()
    hybrid.eval()  # no dropout: the stage fits the model as it will run
    # The teacher is frozen, so its hidden states of the fixed sequences never change: computed once they
    # save a teacher forward per step and one per held-out sequence per evaluation.
    held_t = train_t = None
    # the kept attention layers past the first (layer 0's input is the embedding, the same in both models)
    aux_layers = ([i for i in getattr(hybrid.config, "attention_layers", []) if i > 0]
                  if cfg.attn_input_weight or cfg.attn_map_weight or cfg.attn_query_weight else [])
    if cfg.cache_teacher:
        room, need = memory_budget(dev), _hidden_bytes(teacher, heldout_ids)
        if need <= room:
            held_t, room = teacher_hidden(base_t, heldout_ids, cfg.batch_size, dev), room - need
        if not aux_layers and _hidden_bytes(teacher, train_ids) <= room:
            train_t = teacher_hidden(base_t, train_ids, cfg.batch_size, dev)
    gaps: list[float] = []
    map_kls: list[float] = []
    q_gaps: list[float] = []
    best = before = mean_kl(hybrid, teacher, heldout_ids, cfg.batch_size, held_t)
    best_state, best_step, stale = [p.detach().clone() for p in params], 0, 0
    stale_limit = cfg.stale_limit()
    curve, held_curve = [], [(0, before)]
    steps = range(1, cfg.steps + 1)
    bar = tqdm(steps, desc="KL stage", unit="step", leave=False) if progress else None
    try:
        for p in hybrid.parameters():
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        with torch.enable_grad():
            for step in bar if bar is not None else steps:
                for g in opt.param_groups:
                    g["lr"] = cfg.lr * lr_factor(step - 1, cfg.steps, cfg.schedule, cfg.warmup_steps)
                idx = torch.randint(0, train_ids.shape[0], (min(cfg.batch_size, train_ids.shape[0]),), generator=gen)
                mb = train_ids[idx].to(dev)
                gap = map_kl = q_gap = None
                if aux_layers:  # one teacher pass gives its intermediate and its final states
                    hs, ht, gap, map_kl, q_gap = kept_layer_terms(base_s, base_t, mb, aux_layers,
                                                                  maps=bool(cfg.attn_map_weight), queries=True)
                else:
                    if train_t is not None:
                        ht = train_t[idx.to(dev)]
                    else:
                        with torch.no_grad():
                            ht = final_hidden(base_t, mb)
                    hs = final_hidden(base_s, mb)
                # recomputing the logits in the backward only pays when they would not fit: below
                # 2^28 logits (1 GiB in fp32) it costs a third LM-head pass for nothing
                big = mb.numel() * head_s.weight.shape[0] > 2**28
                loss, kl, _ = chunked_distill_loss(hs.reshape(-1, hs.shape[-1]), head_s,
                                                   ht.reshape(-1, ht.shape[-1]), head_t, use_checkpoint=big)
                if gap is not None:
                    loss = loss + cfg.attn_input_weight * gap
                    gaps.append(float(gap.detach()))
                if map_kl is not None:
                    loss = loss + cfg.attn_map_weight * map_kl
                    map_kls.append(float(map_kl.detach()))
                if q_gap is not None:  # recorded with any kept-layer term: how far the queries are
                    if cfg.attn_query_weight:
                        loss = loss + cfg.attn_query_weight * q_gap
                    q_gaps.append(float(q_gap.detach()))
                if not math.isfinite(kl):
                    log.warning("KL stage: non-finite KL at step %d; restored the best state (step %d) and stopped",
                                step, best_step)
                    break
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.grad_clip:
                    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                opt.step()
                curve.append(kl)
                if step % cfg.eval_every == 0 or step == cfg.steps:
                    held = mean_kl(hybrid, teacher, heldout_ids, cfg.batch_size, held_t)
                    held_curve.append((step, held))
                    if math.isfinite(held) and held < best:
                        best, best_state, best_step, stale = held, [p.detach().clone() for p in params], step, 0
                    else:
                        stale += 1
                        if stale_limit is not None and stale >= stale_limit:
                            break
                if bar is not None:
                    bar.set_postfix(kl=f"{kl:.3f}", best=f"{best:.3f}")
    finally:
        if bar is not None:
            bar.close()
        with torch.no_grad():
            for p, s in zip(params, best_state):
                p.copy_(s)
        for p in hybrid.parameters():
            p.requires_grad_(saved_flags[id(p)])
        hybrid.train(was_training)
        teacher.train(teacher_training)
    return {"steps_run": len(curve), "best_step": best_step, "train_kl": curve, "heldout_curve": held_curve,
            "heldout_kl_before": before, "heldout_kl": best,
            "train_tokens": int(train_ids.numel()), "heldout_tokens": int(heldout_ids.numel()),
            "teacher_cached": {"heldout": held_t is not None, "train": train_t is not None},
            "attn_input_layers": aux_layers, "train_attn_input_gap": gaps, "train_attn_map_kl": map_kls,
            "train_attn_query_gap": q_gaps, "recall": {"frac": cfg.recall_frac, "span": cfg.recall_span},
            "wall_s": time.perf_counter() - t0}
