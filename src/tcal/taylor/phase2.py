"""Taylor-Calibrate Phase 2: layer-local alignment of each GDN layer to its teacher layer.

For every converted layer independently: input = the teacher's normed hidden state entering
that layer (teacher-forced), target = the teacher's attention output after W_o, loss = MSE,
optimiser = AdamW with two learning rates (the reference's: 1e-4 for W_q/W_k/W_v and what
belongs to them, 1e-3 for the gate/decay parameters), W_o and o_norm frozen. The inputs and
targets of every layer come from ONE teacher pass (:func:`tcal.taylor.capture.capture_teacher_io`),
and the layers are then trained back to back.

The state kept is the best one on a held-out slice of the calibration sequences (the last
``heldout_frac`` of them, split off by :func:`tcal.taylor.pipeline.calibrate`), not the one with
the lowest training loss: on a few calibration sequences the training loss keeps falling while
the held-out fit gets worse. The schedule, held-out checks, patience and non-finite guard are the
fit rules every loop shares (:mod:`tcal.utils.fit`); the settings are :class:`tcal.taylor.stage_config.AlignConfig`.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from tcal.modules.gdn import GatedDeltaNet
from tcal.modules.gdn_stack import GDNStack
from tcal.taylor.capture import LayerIO
from tcal.taylor.layer_fit import gdn_device_dtype, layer_output, output_fit
from tcal.taylor.stage_config import AlignConfig
from tcal.utils.errors import TcalError
from tcal.utils.fit import FitState, begin, heldout_check, nonfinite, train_loss
from tcal.utils.fit_tensors import heldout_step, reset_optimizer, restore, set_lr, snapshot
from tcal.utils.runtime import memory_budget

log = logging.getLogger(__name__)

QKV_PARAMS = ("q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "q_norm", "k_norm")
GATE_PARAMS = ("a_proj", "b_proj", "A_log", "dt_bias", "g_proj")
FROZEN_PARAMS = ("o_proj", "o_norm")


def param_groups(gdn: GatedDeltaNet) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter], list[str]]:
    """(q/k/v parameters, gate/decay parameters, names of the frozen ones)."""
    qkv, gate, frozen = [], [], []
    for name, p in gdn.named_parameters():
        root = name.split(".")[0]
        if root in QKV_PARAMS:
            qkv.append(p)
        elif root in GATE_PARAMS:
            gate.append(p)
        elif root in FROZEN_PARAMS:
            frozen.append(name)
        else:
            raise TcalError(f"GDN parameter {name!r} is in no Phase 2 group; update tcal.taylor.phase2")
    return qkv, gate, frozen


class _Minibatches:
    """Indices of the training sequences per step: the full batch, or reshuffled minibatches."""

    def __init__(self, n: int, batch_size: int | None, seed: int, device):
        self.n, self.bs, self.device = n, (n if not batch_size else min(batch_size, n)), device
        self.gen = torch.Generator().manual_seed(seed)
        self.order, self.cursor = (self._shuffle() if self.bs < n else None), 0

    def _shuffle(self) -> torch.Tensor:
        # one copy to the device per epoch: a pageable host-to-GPU copy per step waits for the GPU
        return torch.randperm(self.n, generator=self.gen).to(self.device)

    def next(self) -> torch.Tensor | None:  # None = all sequences
        if self.bs >= self.n:
            return None
        if self.cursor + self.bs > self.n:
            self.order, self.cursor = self._shuffle(), 0
        idx = self.order[self.cursor : self.cursor + self.bs]
        self.cursor += self.bs
        return idx


@contextlib.contextmanager
def _training_only(gdn: GatedDeltaNet, trained: Sequence[torch.nn.Parameter]):
    """Within the block only ``trained`` require gradients; the flags are put back afterwards."""
    saved = {id(p): p.requires_grad for p in gdn.parameters()}
    for p in gdn.parameters():
        p.requires_grad_(False)
    for p in trained:
        p.requires_grad_(True)
    try:
        with torch.enable_grad():
            yield
    finally:
        for p in gdn.parameters():
            p.requires_grad_(saved[id(p)])


def _step(gdn, opt, trained, xb, yb, grad_clip: float) -> float | None:
    """One AdamW step on the MSE to the teacher; the loss, or None if the loss, gradient or the
    updated weights are not finite (the caller then restores the weights and clears the moments).

    The three checks are folded into one tensor that is read together with the loss: one wait for
    the GPU per step instead of one per check and per trained tensor, which left a GPU idle between
    the small kernels of one layer's step. A non-finite loss or gradient still reaches ``opt.step``,
    whose result the caller throws away."""
    opt.zero_grad(set_to_none=True)
    loss = F.mse_loss(gdn(xb)[0].float(), yb)
    loss.backward()
    ok = torch.isfinite(loss)
    if grad_clip:
        ok = ok & torch.isfinite(torch.nn.utils.clip_grad_norm_(trained, grad_clip))
    opt.step()
    ok = ok & torch.stack([torch.isfinite(p).all() for p in trained]).all()
    value, good = torch.stack([loss.detach(), ok.to(loss.dtype)]).tolist()
    return value if good else None


def _optimizer(qkv, gate, cfg: AlignConfig) -> tuple[torch.optim.AdamW, list[float]]:
    """AdamW with the two learning rates, and each group's base rate (the schedule scales them)."""
    groups = [g for g in ({"params": qkv, "lr": cfg.lr_qkv}, {"params": gate, "lr": cfg.lr_gate}) if g["params"]]
    opt = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)
    return opt, [g["lr"] for g in opt.param_groups]


def _warn_nonfinite(layer: int, step: int, fit: FitState, cfg: AlignConfig) -> None:
    if len(fit.nonfinite) == 1:  # the layer's first; its record lists them all
        log.warning("phase 2, layer %s: non-finite loss/gradient/weights at step %d; restored the last good state "
                    "and %s", layer, step, "stopped this layer" if cfg.on_nonfinite == "stop" else "skipped the step")


def _record(layer: int, cfg: AlignConfig, fit: FitState, curve: list, held_curve: list, fits: tuple,
            tokens: tuple[int, int], wall_s: float) -> dict:
    """A layer's Phase-2 record; ``fits``: (train, held-out) fits before and after, each (relative MSE, cosine)."""
    (train_before, held_before), (train_after, held_after) = fits
    return {
        "layer": layer, "steps_run": len(curve), "best_step": fit.best_step, "train_loss": curve,
        "inputs": cfg.inputs, "target": cfg.target, "heldout_curve": held_curve,
        "train_rel_mse_before": train_before[0], "train_cos_before": train_before[1],
        "train_rel_mse": train_after[0], "train_cos": train_after[1],
        "heldout_rel_mse_before": held_before[0], "heldout_cos_before": held_before[1],
        "heldout_rel_mse": held_after[0], "heldout_cos": held_after[1],
        "nonfinite_steps": list(fit.nonfinite), "train_tokens": tokens[0], "heldout_tokens": tokens[1],
        "wall_s": wall_s,
    }


def _tokens(x: torch.Tensor) -> int:
    return int(x.shape[0] * x.shape[1])


def align_layer(
    gdn: GatedDeltaNet,
    train: LayerIO,
    heldout: LayerIO | None,
    cfg: AlignConfig,
    progress: bool = True,
    layer: int | None = None,
) -> dict:
    """Phase 2 on one layer, in place; returns its record (loss curve, held-out fit before/after, best step...)."""
    t0 = time.perf_counter()
    layer = gdn.layer_idx if layer is None else layer
    dev, dt = gdn_device_dtype(gdn)
    x, y = train.x.to(dev, dt), train.out.to(dev).float()
    has_held = heldout is not None and heldout.x.shape[0] > 0
    if has_held:
        hx, hy = heldout.x.to(dev, dt), heldout.out.to(dev).float()
    qkv, gate, _ = param_groups(gdn)
    trained = qkv + gate
    opt, base_lrs = _optimizer(qkv, gate, cfg)
    rules = cfg.fit_rules()

    def held_fit():  # (None, None) without a held-out slice: the record stays valid JSON
        return output_fit(layer_output(gdn, hx), hy) if has_held else (None, None)

    train_before, held_before = output_fit(layer_output(gdn, x), y), held_fit()
    fit = begin(held_before[0] if has_held else None)
    best_state = snapshot(trained)
    curve, held_curve = [], []
    batches = _Minibatches(x.shape[0], cfg.batch_size, cfg.seed, dev)
    steps = range(1, cfg.steps + 1)
    bar = tqdm(steps, desc=f"phase 2 layer {layer}", unit="step", leave=False) if progress else None
    try:
        with _training_only(gdn, trained):
            for step in bar if bar is not None else steps:
                idx = batches.next()
                set_lr(opt, base_lrs, rules.schedule.lr(step - 1))
                before = snapshot(trained)
                lval = _step(gdn, opt, trained, x if idx is None else x[idx], y if idx is None else y[idx],
                             cfg.grad_clip)
                if lval is None:
                    restore(trained, before)
                    reset_optimizer(opt, trained, rules.reset)  # the moments may hold the NaN
                    fit = nonfinite(rules, fit, step)
                    _warn_nonfinite(layer, step, fit, cfg)
                    if fit.stopped:
                        break
                    continue
                curve.append(lval)
                if not has_held:
                    fit = train_loss(fit, step, lval)
                    best_state = before if fit.new_best else best_state
                else:
                    fit, best_state = heldout_step(rules, fit, step, lambda: held_fit()[0], trained, best_state,
                                                   held_curve)
                if fit.stopped:
                    break
                if bar is not None:
                    bar.set_postfix(loss=f"{lval:.3g}", best=fit.best_step)
    finally:
        if bar is not None:
            bar.close()
        restore(trained, best_state)
    fits = ((train_before, held_before), (output_fit(layer_output(gdn, x), y), held_fit()))
    return _record(layer, cfg, fit, curve, held_curve, fits, (_tokens(x), _tokens(hx) if has_held else 0),
                   time.perf_counter() - t0)


def fit_bytes(gdn: GatedDeltaNet, tokens: int) -> int:
    """A rough upper bound on the bytes one Phase-2 training step of ``gdn`` keeps for its backward over
    ``tokens`` tokens (projections, norms, the chunked recurrence's decay matrices and per-chunk states)."""
    D, H, d, C = gdn.shape.hidden_size, gdn.num_heads, gdn.head_dim, gdn.shape.chunk_size
    per_token = 2 * D + H * d * (16 + 2 * d // C) + 6 * H * C
    return 4 * tokens * per_token


def concurrent_groups(gdns: Mapping[int, GatedDeltaNet], layers: Sequence[int], tokens_per_step: int,
                      budget: int) -> list[list[int]]:
    """``layers`` cut, in order, into groups fitted side by side: runs of layers of one shape, each cut
    into equal shares of at most as many layers as one step's activations of all of them fit in
    ``budget`` bytes (equal shares: one compiled shape for the stacked training step)."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and gdns[runs[-1][0]].shape == gdns[i].shape:
            runs[-1].append(i)
        else:
            runs.append([i])
    groups = []
    for run in runs:
        per_group = max(1, budget // max(1, fit_bytes(gdns[run[0]], tokens_per_step)))
        n = -(-len(run) // per_group)
        size = -(-len(run) // n)
        groups += [run[s : s + size] for s in range(0, len(run), size)]
    return groups


def _stack_inputs(parts: Sequence[torch.Tensor], idx: torch.Tensor | None) -> torch.Tensor:
    """(G, B, T, D) from each layer's (N, T, D) rows ``idx`` (all rows for None)."""
    return torch.stack([p if idx is None else p[idx] for p in parts])


# tokens of all layers together per forward of the stack's held-out and before/after checks
FIT_TOKENS = 1 << 16


@torch.no_grad()
def _stack_fit(stack: GDNStack, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> list[tuple[float, float]]:
    """Per layer, :func:`output_fit` of the stack's output on ``xs`` against ``ys``: (relative MSE, mean cosine)."""
    G, n = len(xs), xs[0].shape[0]
    batch_size = max(1, FIT_TOKENS // (G * xs[0].shape[1]))
    err = torch.zeros(G, dtype=torch.float64, device=ys[0].device)
    ref, cos = torch.zeros_like(err), torch.zeros_like(err)
    for s in range(0, n, batch_size):
        pred = stack(_stack_inputs([x[s : s + batch_size] for x in xs], None)).float()
        y = _stack_inputs([t[s : s + batch_size] for t in ys], None)
        err += (pred - y).pow(2).flatten(1).sum(1).double()
        ref += y.pow(2).flatten(1).sum(1).double()
        cos += F.cosine_similarity(pred, y, dim=-1).flatten(1).sum(1).double()
    tokens = n * xs[0].shape[1]
    return [(float(e / max(r, 1e-30)), float(c / tokens)) for e, r, c in zip(err.tolist(), ref.tolist(), cos.tolist())]


def _group_step(stack: GDNStack, opt, trained, xb, yb, grad_clip: float) -> tuple[list[float], list[bool]]:
    """:func:`_step` for every layer of the stack at once: one backward of the sum of the layers' MSEs
    (each layer's gradient is its own loss's: they share no parameter), each layer's gradient clipped by
    its own norm as ``clip_grad_norm_`` clips it, then one AdamW step. Returns each layer's loss and
    whether its loss, gradient and updated weights are finite, read in one wait for the device."""
    opt.zero_grad(set_to_none=True)
    per = (stack(xb).float() - yb).pow(2).flatten(1).mean(1)  # (G,)
    per.sum().backward()
    ok = torch.isfinite(per)
    if grad_clip:
        grads = [p.grad for p in trained if p.grad is not None]
        norms = torch.stack([g.flatten(1).float().pow(2).sum(1) for g in grads]).sum(0).sqrt()  # (G,)
        coef = (grad_clip / (norms + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.view(-1, *([1] * (g.dim() - 1))).to(g.dtype))
        ok = ok & torch.isfinite(norms)
    opt.step()
    ok = ok & torch.stack([torch.isfinite(p).flatten(1).all(1) for p in trained]).all(0)
    values = torch.cat([per.detach(), ok.to(per.dtype)]).tolist()
    G = per.shape[0]
    return values[:G], [v > 0.5 for v in values[G:]]


def align_group(
    gdns: Mapping[int, GatedDeltaNet],
    train: Mapping[int, LayerIO],
    heldout: Mapping[int, LayerIO] | None,
    cfg: AlignConfig,
    progress: bool = True,
) -> dict[int, dict]:
    """Phase 2 on several layers side by side, in place: what :func:`align_layer` does to each, in one
    batched step per step for all of them (:class:`tcal.modules.gdn_stack.GDNStack`). Every layer sees the
    same minibatch order (one seed), keeps its own best held-out state, stops by its own patience or
    non-finite steps; a stopped layer keeps training with the others, its result unused. One difference:
    after a non-finite step a layer's AdamW moments are zeroed but its step count (shared by the stack's
    tensors) is not, where :func:`align_layer` restarts it (``FitRules.reset``). Returns {layer: record};
    each record's ``group`` lists the layers fitted together and ``wall_s`` is its share of their wall time."""
    t0 = time.perf_counter()
    layers = sorted(gdns)
    G = len(layers)
    dev, dt = gdn_device_dtype(gdns[layers[0]])
    xs = [train[i].x.to(dev, dt) for i in layers]
    ys = [train[i].out.to(dev).float() for i in layers]
    if len({x.shape for x in xs}) != 1:
        raise TcalError("the layers fitted together need training activations of one shape (the same sequences)")
    helds = [(heldout or {}).get(i) for i in layers]
    has_held = all(h is not None and h.x.shape[0] > 0 for h in helds)
    hxs = [h.x.to(dev, dt) for h in helds] if has_held else []
    hys = [h.out.to(dev).float() for h in helds] if has_held else []
    stack = GDNStack([gdns[i] for i in layers])
    roots = {n: n.split(".")[0] for n in stack.names}
    unknown = [n for n, r in roots.items() if r not in QKV_PARAMS + GATE_PARAMS + FROZEN_PARAMS]
    if unknown:
        raise TcalError(f"GDN parameter {unknown[0]!r} is in no Phase 2 group; update tcal.taylor.phase2")
    qkv = [stack.param(n) for n in stack.names if roots[n] in QKV_PARAMS]
    gate = [stack.param(n) for n in stack.names if roots[n] in GATE_PARAMS]
    trained = qkv + gate
    for n in stack.names:
        stack.param(n).requires_grad_(roots[n] not in FROZEN_PARAMS)
    opt, base_lrs = _optimizer(qkv, gate, cfg)
    rules = cfg.fit_rules(reset="moments")

    train_before = _stack_fit(stack, xs, ys)
    held_before = _stack_fit(stack, hxs, hys) if has_held else [(None, None)] * G
    fits = [begin(h[0] if has_held else None) for h in held_before]
    best_state = snapshot(trained)
    curves: list[list[float]] = [[] for _ in layers]
    held_curves: list[list] = [[] for _ in layers]
    batches = _Minibatches(xs[0].shape[0], cfg.batch_size, cfg.seed, dev)
    full_x = _stack_inputs(xs, None) if batches.bs >= batches.n else None  # full batch: stacked once
    full_y = _stack_inputs(ys, None) if full_x is not None else None
    steps = range(1, cfg.steps + 1)
    bar = tqdm(steps, desc=f"phase 2 layers {layers[0]}-{layers[-1]} ({G} side by side)", unit="step",
               leave=False) if progress else None
    try:
        with torch.enable_grad():
            for step in bar if bar is not None else steps:
                idx = batches.next()
                set_lr(opt, base_lrs, rules.schedule.lr(step - 1))
                before = snapshot(trained)
                xb = full_x if full_x is not None else _stack_inputs(xs, idx)
                yb = full_y if full_y is not None else _stack_inputs(ys, idx)
                losses, oks = _group_step(stack, opt, trained, xb, yb, cfg.grad_clip)
                stepped = [False] * G
                for j in range(G):
                    if fits[j].stopped:
                        continue
                    if not oks[j]:
                        restore(trained, before, j)
                        reset_optimizer(opt, trained, rules.reset, j)  # the moments may hold the NaN
                        fits[j] = nonfinite(rules, fits[j], step)
                        _warn_nonfinite(layers[j], step, fits[j], cfg)
                        continue
                    curves[j].append(losses[j])
                    stepped[j] = True
                    if not has_held:
                        fits[j] = train_loss(fits[j], step, losses[j])
                        if fits[j].new_best:
                            restore(best_state, before, j)
                if has_held and rules.check_due(step) and any(stepped):
                    rels = [r for r, _ in _stack_fit(stack, hxs, hys)]
                    for j in (j for j in range(G) if stepped[j]):
                        held_curves[j].append((step, rels[j]))
                        fits[j] = heldout_check(rules, fits[j], step, rels[j])
                        if fits[j].new_best:
                            restore(best_state, trained, j)
                if bar is not None:
                    bar.set_postfix(active=sum(not f.stopped for f in fits), loss=f"{sum(losses) / G:.3g}")
                if all(f.stopped for f in fits):
                    break
    finally:
        if bar is not None:
            bar.close()
        restore(trained, best_state)
        stack.write_back()
    train_after = _stack_fit(stack, xs, ys)
    held_after = _stack_fit(stack, hxs, hys) if has_held else [(None, None)] * G
    wall = time.perf_counter() - t0
    return {
        layer: {**_record(layer, cfg, fits[j], curves[j], held_curves[j],
                          ((train_before[j], held_before[j]), (train_after[j], held_after[j])),
                          (_tokens(xs[j]), _tokens(hxs[j]) if has_held else 0), wall / G),
                "group": layers, "group_wall_s": wall}
        for j, layer in enumerate(layers)
    }


def concurrent_on(cfg: AlignConfig, device) -> bool:
    return cfg.concurrent if cfg.concurrent is not None else torch.device(device).type == "cuda"


def align_layers(
    hybrid,
    train: Mapping[int, LayerIO],
    heldout: Mapping[int, LayerIO] | None,
    cfg: AlignConfig | None = None,
    layers: Sequence[int] | None = None,
    progress: bool = True,
) -> dict[int, dict]:
    """Phase 2 on each GDN layer of ``hybrid`` (default: all): back to back, or (``cfg.concurrent``)
    side by side in groups whose steps fit the device's memory budget.

    ``train`` / ``heldout``: {layer: LayerIO} teacher activations of the training and the held-out
    calibration sequences (``heldout`` None or empty: keep the state of lowest training loss).
    """
    cfg = cfg or AlignConfig()
    gdns = hybrid.gdn_modules()
    layers = sorted(gdns) if layers is None else sorted(int(i) for i in layers)
    tr_by, ho_by = {}, {}
    for i in layers:
        if i not in gdns:
            raise TcalError(f"layer {i} is not a GDN layer of this hybrid")
        if i not in train:
            raise TcalError(f"no captured teacher activations for layer {i}")
        tr, ho = train[i], (heldout or {}).get(i)
        if cfg.seq_len:
            tr = tr.select((slice(None), slice(None, cfg.seq_len)))
            ho = None if ho is None else ho.select((slice(None), slice(None, cfg.seq_len)))
        if cfg.train_sequences:
            tr = tr.select(slice(0, cfg.train_sequences))
        tr_by[i], ho_by[i] = tr, ho
    if not layers:
        return {}
    device, _ = gdn_device_dtype(gdns[layers[0]])
    if not concurrent_on(cfg, device) or len(layers) == 1:
        return {i: align_layer(gdns[i], tr_by[i], ho_by[i], cfg, progress=progress, layer=i) for i in layers}
    x0 = tr_by[layers[0]].x
    step_tokens = (min(cfg.batch_size or x0.shape[0], x0.shape[0])) * x0.shape[1]
    records = {}
    for group in concurrent_groups(gdns, layers, step_tokens, memory_budget(device)):
        if len(group) == 1:
            i = group[0]
            records[i] = align_layer(gdns[i], tr_by[i], ho_by[i], cfg, progress=progress, layer=i)
        else:
            held = {i: ho_by[i] for i in group if ho_by[i] is not None}
            records.update(align_group({i: gdns[i] for i in group}, {i: tr_by[i] for i in group}, held, cfg,
                                       progress=progress))
    return records
