"""Fast inference: a static cache and CUDA-graph decoding for tcal hybrids (and their teachers).

    from tcal.models.fast import FastDecoder
    fast = FastDecoder(hybrid, max_len=4096, batch_size=1)      # allocates the cache, captures the step
    tokens = fast.generate(input_ids, max_new_tokens=128, attention_mask=mask)   # greedy, (B, T + 128)

``StaticHybridCache`` preallocates every layer's state once: key/value slots ``(B, H_kv, max_len, d)``
for the attention layers, the conv window and the fp32 recurrent state for the GDN layers. Every
forward writes into those tensors in place (``index_copy_`` / ``copy_``), so one decode step reads and
writes the same addresses every time and can be captured as a CUDA graph and replayed: a token then
costs one ``replay()`` instead of one Python-issued launch per op of every layer.

Why a tcal call and not ``generate()``: ``generate()`` runs logits processors, stopping criteria, mask
building and cache bookkeeping in Python between steps, which is host time per token of the same order as
the whole captured step; and transformers' own compiled path needs its StaticCache
and a fully compilable model (fla's kernels are not). ``FastDecoder.generate`` is greedy with a fixed
number of new tokens (no sampling, no early stop at EOS: cut the output at EOS yourself).

What runs where:
- The decoder layers, norms, MLPs and attention projections are the teacher's own modules; only the
  attention kernel is tcal's: during a prefill it is transformers' SDPA over the filled slots, during
  decode a matmul/softmax over all slots with a validity mask (fp32 scores), which keeps the shapes
  fixed for the graph.
- GDN layers decode with one packed projection GEMM (``GatedDeltaNet.packed_weights``; a copy, the
  checkpoint keeps fla's names) and, on CUDA with fla, fla's fused one-token recurrence (in-kernel q/k
  l2 norm, decay and beta) and gated RMSNorm.
- On CUDA the captured decode step runs the RMSNorms, SiLU products and the attention's masked softmax
  through ``torch.compile``d copies of the same arithmetic (``compile=True``); prefill and CPU runs use the
  modules as they are.
- Left padding works (``attention_mask`` 0...0 1...1 per row): padded slots are never attended to and
  GDN layers treat padded tokens as no-ops, as in the eager model.
- On CPU (or ``cuda_graphs=False``) the same code runs eagerly: that is what the CPU tests check
  against the eager model.

Limits, each a one-line TcalError or a safe fallback: prompt + new tokens beyond ``max_len`` (error), a
new batch size (the cache is rebuilt and the step re-captured), a dtype other than fp32/bf16/fp16 or a
device other than CPU/CUDA (error), fla missing on a GPU (warning; PyTorch GDN kernels), weights
changed after the decoder was built (packed copies refreshed; graphs re-captured if tensors moved).
"""
from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tcal import families
from tcal.modules.gdn import GatedDeltaNet, prefill_inputs
from tcal.modules.norms import head_norm
from tcal.ops import fla_available
from tcal.utils import compat
from tcal.utils.errors import TcalError

log = logging.getLogger(__name__)

ATTENTION = "tcal_static"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class StaticAttention:
    """What the attention layers of one forward on a ``StaticHybridCache`` need. It travels where the
    decoder layers pass their attention mask (they hand it on untouched)."""

    mask: torch.Tensor | None  # bool, True = attend: (B, 1, T, S); None = plain causal over the first S slots
    kv_len: int | None  # prefill: attend to the first kv_len slots; decode (None): to all max_len slots
    fuse: dict | None = None  # decode: compiled "softmax" / "combine" of decode_attention (None = eager ops)


@functools.lru_cache(maxsize=1)
def _fp32_bmm_ok() -> bool:
    """torch.bmm(..., out_dtype=torch.float32) for bf16/fp16 inputs (CUDA, torch >= 2.8)."""
    try:
        a = torch.ones(1, 1, 8, device="cuda", dtype=torch.bfloat16)
        return torch.bmm(a, a.transpose(1, 2), torch.float32).dtype == torch.float32
    except Exception:
        return False


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q (N, M, d) @ k (N, L, d)^T in fp32: bf16-rounded scores would cost softmax ~0.4 % of the logit."""
    kt = k.transpose(1, 2)
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and _fp32_bmm_ok():
        return torch.bmm(q, kt, torch.float32)
    if q.dtype == torch.float32:
        return torch.bmm(q, kt)
    return torch.bmm(q.float(), kt.float())


def masked_softmax(s, mask, scaling: float, dtype):
    """softmax(scaling * s) over the slots ``mask`` allows, cast to ``dtype``: s (B, Hkv, rep, T, L) fp32,
    mask (B, 1, 1, T, L) bool. Compiled, the four passes over the fp32 scores are one."""
    return torch.softmax((s * scaling).masked_fill(~mask, float("-inf")), dim=-1).to(dtype)


def combine_slices(o, dtype):
    """Sum the fp32 partial outputs of the slot slices, o (N, n, M, d), and cast: one pass compiled."""
    return o.sum(1).to(dtype)


def decode_attention(query, key, value, mask, scaling, fuse: dict | None = None):
    """Attention of T new queries over every slot of a static cache.

    query (B, Hq, T, d); key/value (B, Hkv, L, d); mask (B, 1, T, L) bool. Query heads of one KV group are
    adjacent (head h reads KV head h // (Hq / Hkv), as in transformers' repeat_kv), so the group is one
    batched matmul and the cache is read once, not Hq / Hkv times. ``fuse``: compiled copies of
    ``masked_softmax`` and ``combine_slices`` (same arithmetic). Returns (B, T, Hq, d).
    """
    softmax = fuse["softmax"] if fuse else masked_softmax
    combine = fuse["combine"] if fuse else combine_slices
    B, Hq, T, d = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    rep = Hq // Hkv
    q = query.reshape(B * Hkv, rep * T, d)
    s = _scores(q, key.reshape(B * Hkv, L, d)).view(B, Hkv, rep, T, L)  # (B, Hkv, rep, T, L) fp32
    p = softmax(s, mask.view(B, 1, 1, T, L), scaling, value.dtype).view(B * Hkv, rep * T, L)
    v = value.reshape(B * Hkv, L, d)
    n = _split(L, B * Hkv)
    if n > 1:
        # One (rep*T, L) x (L, d) product per KV head is a handful of thread blocks looping over every
        # slot; n slices of the slots run side by side and their fp32 partial sums are added.
        c = L // n
        p = p.view(B * Hkv, rep * T, n, c).transpose(1, 2).reshape(B * Hkv * n, rep * T, c)
        o = combine(_matmul_fp32(p, v.reshape(B * Hkv * n, c, d)).view(B * Hkv, n, rep * T, d), value.dtype)
    else:
        o = torch.bmm(p, v)
    return o.view(B, Hq, T, d).transpose(1, 2)


def _split(L: int, batches: int) -> int:
    """How many slices of the L slots to reduce over in parallel: enough for ~128 products, slices of at
    least 512 slots, and a divisor of L (the cache rounds max_len up to a multiple of 512)."""
    n = 1
    while batches * n < 128 and L % (2 * n) == 0 and L // (2 * n) >= 512:
        n *= 2
    return n


def _matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and _fp32_bmm_ok():
        return torch.bmm(a, b, torch.float32)
    return torch.bmm(a.float(), b.float())


def window_band(q_slots: torch.Tensor, k_slots: torch.Tensor, window: int) -> torch.Tensor:
    """(T, L) bool: key slot k is within ``window`` tokens of query slot q (q - k < window), as transformers'
    sliding-window layers attend. Slots are positions plus the row's left padding, the same for q and k."""
    return (q_slots[:, None] - k_slots[None, :]) < window


def _static_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    spec = attention_mask
    if not isinstance(spec, StaticAttention):
        raise TcalError("attention kernel 'tcal_static' runs only inside tcal.models.fast.FastDecoder")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if spec.kv_len is not None:
        key, value = key[:, :, : spec.kv_len], value[:, :, : spec.kv_len]
        return compat.sdpa_attention()(module, query, key, value, spec.mask, dropout=0.0, scaling=scaling,
                                       is_causal=spec.mask is None)
    return decode_attention(query, key, value, spec.mask, scaling, spec.fuse), None


def _rms_norm(hidden_states, weight, eps: float):
    # transformers' RMSNorm (the w-multiplying kind) op for op (same roundings), so that compiled it is one kernel
    # instead of seven and still the function the eager model computes
    input_dtype = hidden_states.dtype
    h = hidden_states.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(input_dtype)


def _silu_mul(gate, up):
    return F.silu(gate) * up


def _norm_forward(fn, module, hidden_states):
    return fn(hidden_states, module.weight, module.variance_epsilon)


def _mlp_forward(fn, module, x):
    return module.down_proj(fn(module.gate_proj(x), module.up_proj(x)))


class StaticHybridCache:
    """Fixed-address state for every layer of a hybrid (or a plain teacher) at one batch size.

    Attention layers: ``keys[i]`` / ``values[i]`` (B, H_kv, max_len, d), written at ``write_idx`` by
    ``update`` (the call transformers' attention modules make). GDN layers: ``conv[i]`` (B, 3 H d, W - 1)
    or None, ``state[i]`` (B, H, d, d) fp32, read and overwritten by ``GatedDeltaNet.forward_static``.
    ``valid`` (B, max_len) marks the slots holding a real token, ``pos`` (1,) the slot the next token goes
    to, ``pad`` (B,) each row's left padding (a token's rotary position is its slot minus its row's pad).
    """

    is_tcal_static = True

    def __init__(self, model, batch_size: int, max_len: int):
        p = next(model.parameters())
        dev, dtype = p.device, p.dtype
        B, L = batch_size, max_len
        self.batch_size, self.max_len = B, L
        if L >= 2048:  # slot count a multiple of 512, so decode attention can split the slots evenly
            L = -(-L // 512) * 512
        self.slots = L
        self.keys, self.values, self.conv, self.state = {}, {}, {}, {}
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            if isinstance(attn, GatedDeltaNet):
                H, d = attn.num_heads, attn.head_dim
                self.state[i] = torch.zeros(B, H, d, d, device=dev, dtype=torch.float32)
                W = attn.shape.conv_size
                self.conv[i] = (torch.zeros(B, 3 * H * d, W - 1, device=dev, dtype=dtype)
                                if attn.shape.use_short_conv else None)
            else:
                d = attn.head_dim
                hkv = attn.config.num_key_value_heads or attn.config.num_attention_heads
                self.keys[i] = torch.zeros(B, hkv, L, d, device=dev, dtype=dtype)
                self.values[i] = torch.zeros(B, hkv, L, d, device=dev, dtype=dtype)
        self.valid = torch.zeros(B, L, device=dev, dtype=torch.bool)
        self.slot_idx = torch.arange(L, device=dev)  # for the sliding windows' decode masks
        self.pos = torch.zeros(1, device=dev, dtype=torch.long)
        self.pad = torch.zeros(B, device=dev, dtype=torch.long)
        self.tok = torch.zeros(B, 1, device=dev, dtype=torch.long)  # the decode step's input token
        self.write_idx = self.pos
        self.length = 0  # host copy of pos
        self.packed: dict[int, dict] = {}
        self.fused = False
        self.glue: dict | None = None  # compiled GDN prefill functions, set by FastDecoder during a prefill

    # the calls transformers' attention modules make on a cache
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.keys[layer_idx].index_copy_(2, self.write_idx, key_states)
        self.values[layer_idx].index_copy_(2, self.write_idx, value_states)
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def gdn_state(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        return self.conv[layer_idx], self.state[layer_idx]

    def reset(self) -> None:
        """Forget every sequence. Key/value slots keep stale values: ``valid`` hides them."""
        for t in list(self.state.values()) + [c for c in self.conv.values() if c is not None]:
            t.zero_()
        self.valid.zero_()
        self.pos.zero_()
        self.pad.zero_()
        self.length = 0

    def nbytes(self) -> int:
        tensors = [*self.keys.values(), *self.values.values(), *self.state.values(),
                   *(c for c in self.conv.values() if c is not None)]
        return sum(t.numel() * t.element_size() for t in tensors)


def runs(config) -> str | None:
    """Why FastDecoder cannot run a model of this (teacher or hybrid) config (one line), or None: the families it
    runs are those whose :class:`~tcal.families.Family` says ``fast_decoder``."""
    family = families.model_type(config)
    fam = families.find(family)
    if fam is None or fam.model_type != family or not fam.fast_decoder:
        return f"FastDecoder runs {families.supported(lambda f: f.fast_decoder)} models, not {family!r}"
    return None


class FastDecoder:
    """Greedy generation on a static cache, each decode step one CUDA-graph replay (on CUDA).

    ``model``: a ``HybridForCausalLM`` or a causal LM of a family it runs (:func:`runs`), in eval mode, on CPU or
    CUDA, in fp32/bf16/fp16. ``max_len``: slots per sequence (prompt + new tokens - 1 must fit).
    ``cuda_graphs``: default on for CUDA. ``pack``: one projection GEMM per GDN layer (a weight copy:
    4-6 H d x hidden per GDN layer). ``fused``: fla's fused GDN step and gated norm where available.
    ``prefill_graph_max``: prompts up to this many tokens prefill through a captured graph too (one graph
    per (batch, length), at most ``prefill_graphs`` kept); longer ones run eagerly, where launch overhead
    is small next to the GPU work.
    """

    def __init__(self, model, max_len: int, batch_size: int = 1, *, cuda_graphs: bool | None = None,
                 pack: bool = True, fused: bool = True, compile: bool = True, prefill_graph_max: int = 4096,
                 prefill_graphs: int = 4):
        p = next(model.parameters())
        self.model, self.device, self.dtype = model, p.device, p.dtype
        if self.device.type not in ("cpu", "cuda"):
            raise TcalError(f"FastDecoder runs on CPU or CUDA, not {self.device.type}; "
                            "move the model with model.to('cuda') or use model.generate()")
        if self.dtype not in SUPPORTED_DTYPES:
            raise TcalError(f"FastDecoder runs float32/bfloat16/float16 models, not {self.dtype}; "
                            "cast with model.to(torch.bfloat16) or use model.generate()")
        why = runs(model.config)
        if why:
            raise TcalError(f"{why}; use model.generate()")
        if max_len < 1 or batch_size < 1:
            raise TcalError(f"FastDecoder needs max_len >= 1 and batch_size >= 1 (got {max_len}, {batch_size})")
        layers = model.model.layers
        self.gdn = {i: l.self_attn for i, l in enumerate(layers) if isinstance(l.self_attn, GatedDeltaNet)}
        attn = {i: l.self_attn for i, l in enumerate(layers) if not isinstance(l.self_attn, GatedDeltaNet)}
        # the window of each sliding attention layer: some families keep it on the module (None unless the layer
        # slides), others read it from the config; a window as long as the cache never slides
        self.windows = {}
        for i, a in attn.items():
            window = a.sliding_window if hasattr(a, "sliding_window") else getattr(a.config, "sliding_window", None)
            if window and max_len > window:
                self.windows[i] = int(window)
        self._configs = [a.config for a in attn.values()]
        self._rope_by_type = self._rope_layer_types(model.model)
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        if cuda_graphs and self.device.type != "cuda":
            raise TcalError("cuda_graphs=True needs a model on CUDA; leave cuda_graphs unset on CPU")
        if self.gdn and self.device.type == "cuda" and not fla_available():
            log.warning("flash-linear-attention is not installed: FastDecoder's GDN layers run the PyTorch "
                        "kernels (correct, slower); pip install 'tcal[fla]'")
        self.cuda_graphs, self.pack, self.fused = cuda_graphs, pack, fused
        # torch.compile only where a captured graph amortises it: the decode step on CUDA
        self.compile = compile and cuda_graphs
        self._glue: dict = {}
        self._use_glue = False
        self._use_prefill_glue = self.compile and pack
        self.max_len = max_len
        self.prefill_graph_max, self.prefill_graphs = prefill_graph_max, prefill_graphs
        compat.register_attention(ATTENTION, _static_attention)
        self._build(batch_size)

    # -- set-up ------------------------------------------------------------------------------------

    def _fingerprint(self):
        return [(t.data_ptr(), t._version) for t in self.model.parameters()]

    @torch.no_grad()
    def _repack(self) -> None:
        new = {i: m.packed_weights() for i, m in self.gdn.items()} if self.pack else {}
        old = self.cache.packed
        if old.keys() == new.keys():
            for i in new:  # in place: captured graphs keep reading these addresses
                for name, t in new[i].items():
                    if t is not None:
                        old[i][name].copy_(t)
        else:
            self.cache.packed = new

    def _build(self, batch_size: int) -> None:
        self.cache = StaticHybridCache(self.model, batch_size, self.max_len)
        self.cache.fused = self.fused
        self.batch_size = batch_size
        self._repack()
        self._prints = self._fingerprint()
        self._decode_graph = self._decode_out = None
        self._prefill = {}
        if self.cuda_graphs:
            for glue in ((True, False) if self.compile else (False,)):
                self._use_glue = glue
                try:
                    self._decode_graph, self._decode_out = self._capture(self._decode_body)
                    break
                except Exception as e:  # capture is an optimisation: decode eagerly on the same cache
                    log.warning("FastDecoder could not capture the decode step%s (%s: %s)%s",
                                " with compiled norms" if glue else "", type(e).__name__,
                                str(e).splitlines()[0] if str(e) else "",
                                "; trying without" if glue else "; decoding without CUDA graphs")
                    self._decode_graph = None
                    self._use_glue = False
                    self.cache.reset()
            self.cache.reset()  # the warm-up steps wrote into the cache

    def _check_weights(self) -> None:
        prints = self._fingerprint()
        if prints == self._prints:
            return
        moved = [a[0] for a in prints] != [a[0] for a in self._prints]
        if moved:  # captured graphs read the old tensors: capture again
            log.info("FastDecoder: model tensors were replaced since capture; re-capturing")
            self.cache.packed = {}
            self._build(self.batch_size)
        else:
            self._repack()
            self._prints = prints

    def _capture(self, body, warmup: int = 2):
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(warmup):  # compile fla's kernels and run its autotuning outside the capture
                body()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = body()
        return graph, out

    # -- one forward over the teacher's own modules ----------------------------------------------------

    @staticmethod
    def _rope_layer_types(inner) -> list[str] | None:
        """Each layer's type where the model rotates by layer type (Gemma 3: local and global RoPE bases), else
        None (one rotary embedding for every layer)."""
        import inspect

        types = getattr(inner.config, "layer_types", None)
        if types and "layer_type" in inspect.signature(inner.rotary_emb.forward).parameters:
            return list(types)
        return None

    def _forward(self, ids, position_ids, specs: dict, keep) -> torch.Tensor:
        """``specs``: the StaticAttention of full attention (key None) and of each sliding window size."""
        inner = self.model.model
        kw = {compat.CACHE_KWARG: self.cache, "use_cache": True}
        if keep is not None:
            kw["tcal_keep"] = keep
        h = inner.embed_tokens(ids)
        types = self._rope_by_type
        if types is None:
            pe = [inner.rotary_emb(h, position_ids)] * len(inner.layers)
        else:
            by_type = {t: inner.rotary_emb(h, position_ids, t) for t in set(types)}
            pe = [by_type[t] for t in types]
        with compat.attention_implementation(self._configs, ATTENTION):
            for i, layer in enumerate(inner.layers):
                out = layer(h, attention_mask=specs[self.windows.get(i)], position_ids=position_ids,
                            position_embeddings=pe[i], **kw)
                h = out[0] if isinstance(out, tuple) else out
        return self.model.lm_head(inner.norm(h[:, -1:]))[:, -1]  # (B, V): the last position's logits

    def _prefill_body(self, ids, mask, padded: bool) -> torch.Tensor:
        c = self.cache
        B, T = ids.shape
        c.reset()
        c.write_idx = torch.arange(T, device=self.device)
        slots = torch.arange(T, device=self.device)
        causal = torch.ones(T, T, device=self.device, dtype=torch.bool).tril()[None, None]
        if padded:
            m = mask.bool()
            c.valid[:, :T].copy_(m)
            c.pad.copy_((~m).sum(-1))
            position_ids = (mask.long().cumsum(-1) - 1).clamp_min(0)
            keep = mask.to(torch.float32)
        else:
            c.valid[:, :T] = True
            position_ids = slots[None].expand(B, T)
            keep = None

        def spec(window):
            if window is None and not padded:
                return StaticAttention(None, T)  # plain causal: SDPA's own causal kernel
            allowed = causal if window is None else causal & window_band(slots, slots, window)
            if padded:
                allowed = allowed & m[:, None, None, :]
                # A padded query sees no real key; let it see everything (its output is never used) rather than
                # softmax over nothing, which is NaN and would reach real tokens through 0 * NaN.
                allowed = allowed | ~allowed.any(-1, keepdim=True)
            return StaticAttention(allowed, T)

        specs = {w: spec(w) for w in {None, *self.windows.values()}}
        with self._compiled_glue("prefill"):
            logits = self._forward(ids, position_ids, specs, keep)
        c.pos.fill_(T)
        return logits

    def _glue_modules(self, phase: str = "decode"):
        """(module, compiled forward) for the RMSNorms and SiLU MLPs: at one token their element-wise ops are
        most of a decoder layer's kernels, and compiled each norm or SiLU-product is one. The decode step
        has one shape (``dynamic=False``); prefills come in many lengths, so theirs may go dynamic."""
        if phase not in self._glue:
            dynamic = False if phase == "decode" else None
            norm = torch.compile(_rms_norm, dynamic=dynamic)
            silu_mul = torch.compile(_silu_mul, dynamic=dynamic)
            inner = self.model.model
            glue = []
            for mod in [inner.norm, *(m for l in inner.layers for m in (l.input_layernorm, l.post_attention_layernorm))]:
                if hasattr(mod, "variance_epsilon") and type(mod).__name__.endswith("RMSNorm"):
                    glue.append((mod, functools.partial(_norm_forward, norm, mod)))
            for layer in inner.layers:
                mlp = layer.mlp
                act = getattr(getattr(mlp, "config", None), "hidden_act", None)
                if act == "silu" and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
                    glue.append((mlp, functools.partial(_mlp_forward, silu_mul, mlp)))
            self._glue[phase] = glue
        return self._glue[phase]

    @contextlib.contextmanager
    def _compiled_glue(self, phase: str = "decode"):
        on = self._use_glue if phase == "decode" else self._use_prefill_glue
        if not on:
            yield
            return
        glue = self._glue_modules(phase)
        for mod, fn in glue:
            mod.forward = fn  # an instance attribute: the class's forward stays what everyone else calls
        if phase == "prefill":
            self.cache.glue = self._gdn_prefill_glue()
        try:
            yield
        finally:
            for mod, _ in glue:
                del mod.forward
            self.cache.glue = None

    def _attention_glue(self) -> dict:
        """Compiled ``masked_softmax`` / ``combine_slices`` for the decode step's attention layers: at 32K
        slots scaling, masking, softmax and cast are four passes over (B, Hq, L) fp32 scores eagerly."""
        if "attention" not in self._glue:
            self._glue["attention"] = {"softmax": torch.compile(masked_softmax, dynamic=False),
                                       "combine": torch.compile(combine_slices, dynamic=False)}
        return self._glue["attention"]

    def _gdn_prefill_glue(self) -> dict:
        """Compiled ``prefill_inputs`` / ``head_norm`` for the GDN layers' packed prefill."""
        if "gdn" not in self._glue:
            self._glue["gdn"] = {"inputs": torch.compile(prefill_inputs), "norm": torch.compile(head_norm)}
        return self._glue["gdn"]

    def _decode_body(self) -> torch.Tensor:
        c = self.cache
        c.write_idx = c.pos
        c.valid.index_fill_(1, c.pos, True)
        position_ids = (c.pos - c.pad).view(-1, 1)
        with self._compiled_glue():
            fuse = self._attention_glue() if self._use_glue else None
            specs = {None: StaticAttention(c.valid[:, None, None, :], None, fuse)}
            for w in set(self.windows.values()):  # slots within the window of the token at slot pos
                near = window_band(c.pos, c.slot_idx, w)  # (1, L)
                specs[w] = StaticAttention((c.valid & near)[:, None, None, :], None, fuse)
            logits = self._forward(c.tok, position_ids, specs, None)
        c.pos.add_(1)
        c.tok.copy_(logits.argmax(-1, keepdim=True))
        return logits

    # -- public calls --------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Reset the cache and run the prompt (B, T), left-padded where ``attention_mask`` has zeros.
        Returns the last position's logits (B, vocab); the next ``step`` continues from here."""
        input_ids = input_ids.to(self.device)
        B, T = input_ids.shape
        if T > self.max_len:
            raise TcalError(f"the prompt has {T} tokens but FastDecoder's static cache holds {self.max_len}; "
                            f"build it with max_len >= {T}")
        if B != self.batch_size:
            log.info("FastDecoder: batch size %d -> %d, rebuilding the cache and re-capturing", self.batch_size, B)
            self._build(B)
        self._check_weights()
        padded = False
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
            if attention_mask.shape != input_ids.shape:
                raise TcalError(f"attention_mask {tuple(attention_mask.shape)} does not match input_ids {(B, T)}")
            padded = not bool(attention_mask.all())
            if padded and not (bool((attention_mask[:, 1:] >= attention_mask[:, :-1]).all())
                               and bool(attention_mask[:, -1].all())):
                raise TcalError("FastDecoder takes left padding only (each mask row 0...0 1...1); "
                                "set tokenizer.padding_side = 'left'")
        try:
            logits = self._run_prefill(input_ids, attention_mask, padded)
        except Exception as e:  # compiling is an optimisation: prefill with the modules as they are
            if not self._use_prefill_glue:
                raise
            log.warning("FastDecoder could not compile the prefill's element-wise work (%s: %s); "
                        "prefilling without it", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            self._use_prefill_glue = False
            self._prefill = {}
            logits = self._run_prefill(input_ids, attention_mask, padded)
        self.cache.length = T
        return logits

    def _run_prefill(self, input_ids, attention_mask, padded):
        if self.cuda_graphs and input_ids.shape[1] <= self.prefill_graph_max:
            return self._graph_prefill(input_ids, attention_mask, padded)
        return self._prefill_body(input_ids, attention_mask, padded)

    def _graph_prefill(self, ids, mask, padded):
        key = (ids.shape, padded)
        entry = self._prefill.pop(key, None)
        if entry is None:
            ids_buf = ids.clone()
            mask_buf = mask.clone() if padded else None
            try:
                graph, out = self._capture(lambda: self._prefill_body(ids_buf, mask_buf, padded))
            except Exception as e:
                if self._use_prefill_glue:  # maybe the compiled glue: prefill.__call__ retries without it
                    raise
                log.warning("FastDecoder could not capture the prefill (%s); prefilling without CUDA graphs",
                            type(e).__name__)
                self.prefill_graph_max = 0
                return self._prefill_body(ids, mask, padded)
            entry = (graph, out, ids_buf, mask_buf)
            while len(self._prefill) >= self.prefill_graphs:
                self._prefill.pop(next(iter(self._prefill)))
        self._prefill[key] = entry  # most recently used last
        graph, out, ids_buf, mask_buf = entry
        ids_buf.copy_(ids)
        if padded:
            mask_buf.copy_(mask)
        graph.replay()
        return out.clone()  # the next replay overwrites the graph's output

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (B, 1) after ``prefill``/``step``; returns its logits (B, vocab)."""
        c = self.cache
        if c.length >= self.max_len:
            raise TcalError(f"FastDecoder's static cache is full ({self.max_len} tokens); "
                            f"build it with a larger max_len")
        c.tok.copy_(tokens.view(self.batch_size, 1))
        return self._step().clone()

    def _step(self) -> torch.Tensor:
        if self._decode_graph is not None:
            self._decode_graph.replay()
            out = self._decode_out
        else:
            out = self._decode_body()
        self.cache.length += 1
        return out

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy: (B, T) prompt -> (B, T + max_new_tokens) tokens, always exactly max_new_tokens new ones."""
        B, T = input_ids.shape
        if max_new_tokens < 1:
            raise TcalError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
        need = T + max_new_tokens - 1  # the last new token is never fed back
        if need > self.max_len:
            raise TcalError(f"prompt ({T}) + max_new_tokens ({max_new_tokens}) needs {need} cache slots but "
                            f"FastDecoder was built with max_len={self.max_len}; build it with max_len >= {need}")
        logits = self.prefill(input_ids, attention_mask)
        c = self.cache
        c.tok.copy_(logits.argmax(-1, keepdim=True))
        out = [c.tok.clone()]
        for _ in range(max_new_tokens - 1):
            self._step()  # the step writes its greedy token back into c.tok
            out.append(c.tok.clone())
        return torch.cat([input_ids.to(self.device), *out], dim=1)
