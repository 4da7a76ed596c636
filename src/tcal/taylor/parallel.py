"""Calibration over several processes: layer-local Phase 2 spread over the ranks, results shared.

Phase 2 on the teacher's inputs fits every layer from the teacher's activations alone, each with
its own minibatch generator seeded from the config, so a layer's fit depends on nothing another
layer does: rank r fits layers ``sorted[r::W]`` and every layer's weights are then broadcast from
the rank that fitted it. The result equals the one-process result.

The process group is the default one, when a program (``torchrun``) has initialised it: the
calibration stages are called from deep inside a conversion, so the ranks are read here rather
than handed down through every caller. Everything is a no-op in one process.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def ranks() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def owners(layers: Sequence[int], world_size: int) -> dict[int, int]:
    """Which rank fits each layer: round-robin over the sorted layers (balanced when layers cost alike)."""
    return {layer: i % world_size for i, layer in enumerate(sorted(layers))}


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [t for _, t in module.named_parameters()] + [t for _, t in module.named_buffers()]


@torch.no_grad()
def broadcast_module(module: torch.nn.Module, src: int) -> None:
    """Every parameter and buffer of ``module`` from rank ``src`` to the others, in place."""
    import torch.distributed as dist

    for t in _tensors(module):
        buf = t.detach()
        if not buf.is_contiguous():
            tmp = buf.contiguous()
            dist.broadcast(tmp, src=src)
            buf.copy_(tmp)
        else:
            dist.broadcast(buf, src=src)


def share_layers(modules: Mapping[int, torch.nn.Module], owner: Mapping[int, int], records: dict) -> dict:
    """Broadcast each layer's module from its owner and merge every rank's records (sorted by layer)."""
    import torch.distributed as dist

    for layer in sorted(modules):
        broadcast_module(modules[layer], owner[layer])
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    merged = {}
    for part in gathered:
        merged.update(part)
    return {k: merged[k] for k in sorted(merged)}


def from_rank0(modules: Mapping[int, torch.nn.Module], record):
    """Rank 0's modules and record on every rank (a stage run by rank 0 alone, or identically by all)."""
    import torch.distributed as dist

    for layer in sorted(modules):
        broadcast_module(modules[layer], 0)
    box = [record]
    dist.broadcast_object_list(box, src=0)
    return box[0]
