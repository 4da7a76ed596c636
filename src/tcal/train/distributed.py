"""Several processes (``torchrun --nproc_per_node N``): the world, FSDP2 sharding, full state dicts.

Everything here is a no-op or a plain single-process call when the world has one process, so the
single-process trainer keeps its numbers bit for bit. Multi-process training is data parallel:

- the student is sharded with FSDP2 (``fully_shard`` on every decoder layer, then on the root),
  so its weights, gradients and AdamW moments are split over the ranks;
- the frozen teacher is replicated when it fits comfortably and sharded otherwise
  (:func:`teacher_placement`): frozen, it has no gradients or optimizer state, so one copy per rank
  costs 1x its weights, while sharding it costs an all-gather of every layer in every forward;
- each rank trains on its slice of the global batch (:func:`local_rows`), and FSDP2 averages the
  gradients over the ranks, so a step sees the same tokens and the same mean gradient as one process;
- checkpoints hold full (gathered) state dicts, so a run resumes at any world size.
"""
from __future__ import annotations

import datetime
import hashlib
import os
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from tcal.train.options import TEACHER_PLACEMENTS
from tcal.utils.errors import TcalError

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# auto replicates a teacher whose weights take at most this fraction of one device's memory: the
# rest holds the student's shard, its gradients and moments, the activations and a KL chunk
REPLICATE_MAX_FRACTION = 0.40


@dataclass(frozen=True)
class World:
    """This process's place among the ranks (one process: rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"
    initialised: bool = False  # whether this process is in a process group (torchrun, even with 1 process)
    owner: bool = False  # whether init_from_env created that group (and destroy() ends it)

    @property
    def distributed(self) -> bool:
        """Whether work is split over ranks (a torchrun with one process runs the single-process path)."""
        return self.world_size > 1

    def is_main(self) -> bool:
        return self.rank == 0


def env_ranks(env: Mapping[str, str]) -> tuple[int, int, int] | None:
    """(rank, world size, local rank) from torchrun's variables, or None when not launched by it."""
    if "WORLD_SIZE" not in env:
        return None
    try:
        rank, world, local = (int(env.get(k, "0")) for k in ENV_KEYS)
    except ValueError:
        raise TcalError(f"RANK/WORLD_SIZE/LOCAL_RANK must be integers, got "
                        f"{', '.join(f'{k}={env.get(k)!r}' for k in ENV_KEYS)}; launch with torchrun") from None
    if world < 1 or not 0 <= rank < world or local < 0:
        raise TcalError(f"inconsistent torchrun variables RANK={rank} WORLD_SIZE={world} LOCAL_RANK={local}; "
                        "launch with torchrun --nproc_per_node N")
    return rank, world, local


def launched() -> bool:
    """Whether this process was started by torchrun (or anything that sets WORLD_SIZE)."""
    return env_ranks(os.environ) is not None


def rank_device(device: str, local_rank: int, world_size: int) -> str:
    """The device of one rank: cuda:LOCAL_RANK on GPUs, the CPU otherwise."""
    if device.startswith("cuda"):
        if ":" in device and world_size > 1:
            raise TcalError(f"--device {device} names one GPU, but {world_size} processes each need their own; "
                            "pass --device cuda (rank r uses cuda:LOCAL_RANK)")
        return device if ":" in device else f"cuda:{local_rank}"
    return device


def init_from_env(device: str, timeout_minutes: float = 30.0) -> World:
    """Join torchrun's process group (nccl on GPUs, gloo on the CPU); one plain process outside torchrun.

    ``device``: the resolved --device (cpu, cuda, cuda:N). ``timeout_minutes`` bounds every
    collective, so a rank that hangs (or an NCCL deadlock) ends the run instead of blocking it.
    """
    ranks = env_ranks(os.environ)
    if ranks is None:
        return World(device=device)
    rank, world, local = ranks
    dev = rank_device(device, local, world)
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        if timeout_minutes <= 0:
            raise TcalError(f"--dist-timeout must be a positive number of minutes, got {timeout_minutes}")
        backend = "nccl" if dev.startswith("cuda") else "gloo"
        if dev.startswith("cuda"):
            torch.cuda.set_device(torch.device(dev))
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    return World(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local, device=dev,
                 initialised=True, owner=created)


def destroy(world: World) -> None:
    """End the process group that :func:`init_from_env` created (one created by the caller stays)."""
    import torch.distributed as dist

    if world.owner and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a group whose peers are gone may fail to close; the process is ending anyway
            pass


def barrier(world: World) -> None:
    """Wait for every rank (e.g. for rank 0's write before the others read)."""
    if world.distributed:
        import torch.distributed as dist

        dist.barrier()


# ---------------------------------------------------------------------------------------------
# the batch: pure
# ---------------------------------------------------------------------------------------------


def check_batch_split(batch_size: int, micro_batch: int, world_size: int) -> int:
    """The rows each rank trains on per step (``batch_size / world_size``); a one-line error when the
    world size does not divide the global batch or the micro-batch does not divide the local rows."""
    if world_size < 1:
        raise TcalError(f"the world size must be >= 1, got {world_size}")
    if batch_size % world_size:
        lower = batch_size - batch_size % world_size
        raise TcalError(f"--batch-size {batch_size} is not divisible by the {world_size} processes; use a multiple "
                        f"of {world_size} (e.g. {lower or world_size} or {lower + world_size}) or another "
                        "--nproc_per_node")
    local = batch_size // world_size
    if micro_batch and local % micro_batch:
        raise TcalError(f"--micro-batch {micro_batch} must divide the {local} sequences each of the {world_size} "
                        f"processes trains on (--batch-size {batch_size} / {world_size}); use a divisor of {local} "
                        "or 0")
    return local


def local_rows(batch_size: int, world_size: int, rank: int) -> range:
    """Rows ``[r B/W, (r+1) B/W)`` of a step's global batch: the ranks' rows together are the batch, in order."""
    n = check_batch_split(batch_size, 0, world_size)
    if not 0 <= rank < world_size:
        raise TcalError(f"rank {rank} is outside a world of {world_size}")
    return range(rank * n, (rank + 1) * n)


# ---------------------------------------------------------------------------------------------
# agreement at start-up
# ---------------------------------------------------------------------------------------------


def array_digest(a) -> str:
    a = np.ascontiguousarray(np.asarray(a))
    return hashlib.sha256(str((a.dtype.str, a.shape)).encode() + a.tobytes()).hexdigest()[:16]


def data_fingerprint(train_tokens: np.ndarray, eval_ids, sample: int = 1 << 16) -> dict:
    """What must match across ranks about the data: token counts and hashes of a strided sample of the
    training tokens (cheap on a pool of billions) and of every evaluation id."""
    n = int(train_tokens.shape[0])
    step = max(1, n // sample)
    return {"train_tokens": n, "train_sample_sha": array_digest(np.asarray(train_tokens[::step][:sample])),
            "eval_sha": array_digest(torch.as_tensor(eval_ids).cpu().numpy())}


def model_fingerprint(model: nn.Module, values: int = 64) -> str:
    """Names, shapes, dtypes and the first ``values`` numbers of every tensor of a model (unsharded)."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.detach().reshape(-1)[:values].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def first_disagreement(fingerprints: Sequence[Mapping]) -> tuple[str, dict[int, object]] | None:
    """(the first key, sorted, whose value differs between ranks; {rank: value}) or None when all agree."""
    keys = sorted(set().union(*fingerprints)) if fingerprints else []
    missing = object()
    for key in keys:
        values = [fp.get(key, missing) for fp in fingerprints]
        if any(v != values[0] for v in values[1:]):
            return key, {r: (None if v is missing else v) for r, v in enumerate(values)}
    return None


def disagreement_message(key: str, values: Mapping[int, object]) -> str:
    groups: dict[str, list[int]] = {}
    for r, v in values.items():
        groups.setdefault(repr(v), []).append(r)
    shown = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {v[:60]}"
                      for v, rs in groups.items())
    return (f"the processes disagree on {key} ({shown}); every rank must get the same command line, data and "
            "model files")


def check_agreement(world: World, fingerprint: Mapping) -> None:
    """Every rank's ``fingerprint`` (settings + data + model; flat, JSON-like values) must be equal."""
    if not world.distributed:
        return
    import torch.distributed as dist

    gathered: list = [None] * world.world_size
    dist.all_gather_object(gathered, dict(fingerprint))
    diff = first_disagreement(gathered)
    if diff is not None:
        raise TcalError(disagreement_message(*diff))


def on_main(world: World, fn: Callable[[], object]):
    """Run ``fn`` on rank 0 only (file-system changes) and give every rank its result. A failure there
    is raised on every rank (a TcalError as itself, anything else as a TcalError naming it), so no
    rank waits for one that gave up."""
    if not world.distributed:
        return fn()
    import torch.distributed as dist

    box = [None]
    if world.is_main():
        try:
            box = [("ok", fn())]
        except TcalError as err:
            dist.broadcast_object_list([("error", str(err))], src=0)
            raise
        except Exception as err:
            dist.broadcast_object_list([("failed", f"{type(err).__name__}: {err}")], src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise TcalError(value)
    if kind == "failed":
        raise TcalError(f"rank {world.rank}: rank 0 stopped ({value}); see its message")
    return value


def all_mean(value: float, world: World) -> float:
    """The mean of a float over the ranks (the value itself in one process)."""
    if not world.distributed:
        return value
    import torch.distributed as dist

    t = torch.tensor([float(value)], dtype=torch.float64, device=_comm_device(world))
    dist.all_reduce(t)
    return float(t.item()) / world.world_size


def any_rank(flag: bool, world: World) -> bool:
    if not world.distributed:
        return flag
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_comm_device(world))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _comm_device(world: World) -> torch.device:
    return torch.device(world.device) if world.device.startswith("cuda") else torch.device("cpu")


def peer_lost(err: BaseException) -> bool:
    """Whether an exception is a collective failing because another rank is gone (a closed socket, a
    timed-out or aborted NCCL communicator), not a bug of this rank."""
    import torch.distributed as dist

    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    if isinstance(err, RuntimeError) and not isinstance(err, torch.OutOfMemoryError):
        text = str(err).lower()
        return any(s in text for s in ("gloo", "nccl", "connection", "peer", "timed out", "socket", "broken pipe"))
    return False


# ---------------------------------------------------------------------------------------------
# FSDP2
# ---------------------------------------------------------------------------------------------


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of an HF causal LM or a tcal hybrid (``model.model.layers`` / ``model.layers``)."""
    for owner in (getattr(model, "model", None), model):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers):
            return list(layers)
    raise TcalError(f"{type(model).__name__} has no decoder layers at model.layers or model.model.layers; "
                    "multi-process training supports HF decoder-only causal LMs")


def _hidden_states(self, ids: torch.Tensor) -> torch.Tensor:
    base = getattr(self, getattr(self, "base_model_prefix", "model") or "model")
    out = base(input_ids=ids, use_cache=False)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def shard(model: nn.Module, world: World) -> Callable[[torch.Tensor], torch.Tensor]:
    """FSDP2 over ``model`` in place (every decoder layer, then the root: embeddings, final norm and LM
    head, tied or not, in one group); returns ``hidden(ids)``, the final-norm hidden states.

    The trainer runs the decoder (``model.model``) and reads the LM head's weight itself, never
    ``model.forward``; FSDP2 gathers the root's parameters only in the hooks of a forward method, so
    ``hidden`` is registered as one (``register_fsdp_forward_method``). The root keeps its parameters
    gathered from forward to backward (FSDP2's default for a root), which the chunked KL, recomputing
    the LM head in the backward pass, relies on.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    dev = torch.device(world.device)
    mesh = init_device_mesh(dev.type, (world.world_size,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.tcal_hidden_states = types.MethodType(_hidden_states, model)
    register_fsdp_forward_method(model, "tcal_hidden_states")
    return model.tcal_hidden_states


def weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def device_memory(device: str) -> int | None:
    """Total memory of a GPU in bytes; None on the CPU (no device limit to plan against)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return None


def teacher_placement(placement: str, weights: int, memory: int | None) -> str:
    """``replicate`` or ``shard`` for the frozen teacher. ``auto`` replicates unless its weights exceed
    REPLICATE_MAX_FRACTION of one device's memory (on the CPU, with no device to fill: replicate).

    Replicated, the teacher costs 1x its weights per rank and no communication; sharded, 1/W of them
    plus an all-gather of every layer in every forward (the teacher runs once per micro-batch).
    """
    if placement not in TEACHER_PLACEMENTS:
        raise TcalError(f"unknown --teacher-placement {placement!r}; choose one of {', '.join(TEACHER_PLACEMENTS)}")
    if placement != "auto":
        return placement
    if memory is None:
        return "replicate"
    return "replicate" if weights <= REPLICATE_MAX_FRACTION * memory else "shard"


_FULL = dict(full_state_dict=True, cpu_offload=True)


def full_model_state(model: nn.Module) -> dict:
    """The model's full state dict on the CPU: gathered on rank 0 (other ranks get {}) when sharded."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(**_FULL))


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer state keyed by parameter name (FQN), full, on the CPU (rank 0 only when sharded):
    the same file whatever the world size that writes or reads it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(**_FULL))


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a full FQN-keyed optimizer state (every rank passes the same one) into a fresh optimizer,
    each rank keeping its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def plain_model(cls: type, config, state: dict, buffers: Mapping[str, torch.Tensor]) -> nn.Module:
    """An unsharded CPU model of class ``cls`` holding a full state dict: what rank 0 saves and returns.

    Built on the meta device and filled by assignment (no second initialisation of the weights);
    non-persistent buffers (rotary frequencies), absent from state dicts, come from ``buffers``.
    """
    with torch.device("meta"):
        model = cls(config)
    model.load_state_dict(state, strict=False, assign=True)
    for name, buf in buffers.items():
        owner, _, leaf = name.rpartition(".")
        mod = model.get_submodule(owner) if owner else model
        persistent = leaf not in getattr(mod, "_non_persistent_buffers_set", set())
        mod.register_buffer(leaf, buf.detach().to("cpu").clone(), persistent=persistent)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise TcalError(f"rebuilding the gathered model left {left[0]} unset; report this as a tcal bug")
    return model.eval()
