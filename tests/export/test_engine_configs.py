"""The exported config.json read by vLLM's and SGLang's own code, for tiny random Llama, Qwen2, Qwen3 and Mistral
teachers with a periodic placement (attention at 1 and 3 of 4 layers: full_attention_interval 2) and another one
(0 and 2), and the export's engine table held to what that code says.

What runs (their released source, fetched once with pip, see engine_code.py; neither engine is installed):
- SGLang 0.5.23: its config classes (srt/configs/qwen3_next.py, qwen3_5.py, imported by path, their runtime-only
  imports stubbed) parse the file; its layer placement (Qwen3NextConfig.layers_block_type), rotary config
  (get_rope_config), GDN state dtype (mamba2_state_dtype) and model dtype (_get_and_verify_dtype) run on it; the
  attention's bias argument and rotary-factor read are taken from srt/models/qwen3_5.py and evaluated on it.
- vLLM 0.34.0: it parses the file with transformers' own Qwen3_5TextConfig (as here); its Qwen3.5 config hook
  (Qwen3_5ForCausalLMConfig: GDN state dtype, M-RoPE fields), get_rope (rotary dims and theta, with recording
  rotary classes), the GDN state dtype calculator, the auto dtype, and the GDN prefill backend choice run on it;
  the q/k/v and o_proj bias arguments of Qwen3NextAttention are evaluated on it.
Not run: the engines' kernels and weight loaders (they need a GPU); FlashInfer's head-size-128 limit is read from
its source (docs/serving.md).
"""
import json
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from engine_code import assigned_expr, definitions, engine_files, import_by_path, keyword_expr, stub_module
from helpers import FAMILIES, TINY, target_hybrid, word_tokenizer

from tcal.cli import main

SGLANG = ("sglang", "0.5.23")
SGLANG_FILES = ["sglang/srt/configs/qwen3_next.py", "sglang/srt/configs/qwen3_5.py",
                "sglang/srt/configs/mamba_utils.py", "sglang/srt/configs/model_config.py",
                "sglang/srt/utils/hf_transformers/common.py", "sglang/srt/models/qwen3_5.py"]
VLLM = ("vllm", "0.34.0")
VLLM_FILES = ["vllm/model_executor/models/config.py", "vllm/model_executor/models/qwen3_next.py",
              "vllm/model_executor/layers/rotary_embedding/__init__.py", "vllm/config/model.py",
              "vllm/model_executor/layers/mamba/mamba_utils.py", "vllm/utils/torch_utils.py",
              "vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py"]
PLACEMENTS = {"periodic": (1, 3), "other": (0, 2)}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{(family, placement): (export directory, export.json)} of tiny hybrids exported with `tcal export`."""
    out = {}
    root = tmp_path_factory.mktemp("engine-exports")
    tok = word_tokenizer([f"w{i}" for i in range(TINY["vocab_size"] - 2)])
    for family in FAMILIES:
        for placement, keep in PLACEMENTS.items():
            hybrid, _ = target_hybrid(family, keep=keep)
            src, dst = root / f"{family}-{placement}", root / f"{family}-{placement}-hf"
            hybrid.save_pretrained(src)
            tok.save_pretrained(src)
            assert main(["export", str(src), "--out", str(dst), "--no-check"]) == 0
            out[family, placement] = dst, json.loads((dst / "export.json").read_text())
    return out


def engine_verdict(record, engine):
    return next(e for e in record["engines"] if e["engine"] == engine)


# -- SGLang ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sglang():
    root = engine_files(*SGLANG, SGLANG_FILES)
    srt = root / "sglang" / "srt"
    from transformers import PretrainedConfig

    stubs = {
        "sglang": stub_module("sglang"), "sglang.srt": stub_module("sglang.srt"),
        "sglang.srt.configs": stub_module("sglang.srt.configs"),
        "sglang.srt.configs.mamba_utils": stub_module("sglang.srt.configs.mamba_utils", Mamba2CacheParams=mock.Mock(),
                                                      Mamba2StateShape=mock.Mock(), mamba2_state_dtype=mock.Mock()),
        "sglang.srt.configs.update_config": stub_module("sglang.srt.configs.update_config",
                                                        adjust_tp_num_heads_if_necessary=mock.Mock()),
        "sglang.srt.runtime_context": stub_module("sglang.srt.runtime_context", get_parallel=mock.Mock(),
                                                  linear_attn_tp_size=mock.Mock(return_value=1)),
        "sglang.srt.utils": stub_module("sglang.srt.utils", is_cpu=lambda: False),
        "sglang.srt.configs.qwen3_vl": stub_module("sglang.srt.configs.qwen3_vl",
                                                   Qwen3VLVisionConfig=type("Qwen3VLVisionConfig", (PretrainedConfig,),
                                                                            {})),
    }
    next_mod = import_by_path(srt / "configs" / "qwen3_next.py", "sglang.srt.configs.qwen3_next", stubs)
    stubs["sglang.srt.configs.qwen3_next"] = next_mod
    qwen3_5 = import_by_path(srt / "configs" / "qwen3_5.py", "sglang.srt.configs.qwen3_5", stubs)
    env = SimpleNamespace(SGLANG_MAMBA_CONV_DTYPE=SimpleNamespace(get=lambda: None),
                          SGLANG_MAMBA_SSM_DTYPE=SimpleNamespace(get=lambda: None))
    from dataclasses import dataclass

    ns = {"torch": torch, "envs": env, "logger": mock.Mock(), "dataclass": dataclass, "Optional": object,
          "Union": object}
    definitions(srt / "configs" / "mamba_utils.py", ["Mamba2StateDType", "mamba2_state_dtype"], ns)
    definitions(srt / "configs" / "model_config.py", ["_STR_DTYPE_TO_TORCH_DTYPE", "_get_and_verify_dtype"], ns)
    definitions(srt / "utils" / "hf_transformers" / "common.py", ["get_rope_config"], ns)
    model = srt / "models" / "qwen3_5.py"
    return SimpleNamespace(TextConfig=qwen3_5.Qwen3_5TextConfig, ns=ns, model=model)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_sglang_reads_the_export(sglang, exports, family, placement):
    path, record = exports[family, placement]
    raw = json.loads((path / "config.json").read_text())
    cfg = sglang.TextConfig(**raw)
    verdict = engine_verdict(record, "SGLang")
    layer_types = raw["layer_types"]
    if placement == "other":
        with pytest.raises(AttributeError, match="full_attention_interval"):
            _ = cfg.layers_block_type  # SGLang's placement: without the interval it refuses the model
        # the teacher's biases are named first: no other placement would let SGLang run a Qwen2 hybrid
        assert verdict["runs"] == "cannot" and ("bias" if raw["qkv_bias"] else "full_attention_interval") in verdict["how"]
        return
    placed = ["full_attention" if t == "attention" else t for t in cfg.layers_block_type]
    assert placed == layer_types  # SGLang puts attention exactly where the hybrid has it
    # the rotary factor its attention reads (a quarter of each head by its config's default), and theta
    factor_expr = assigned_expr(sglang.model, "Qwen3_5AttentionDecoderLayer", "__init__", "partial_rotary_factor")
    assert eval(factor_expr, {"config": cfg, "getattr": getattr}) == 1.0  # noqa: S307
    theta, _ = sglang.ns["get_rope_config"](cfg)
    assert theta == raw["rope_parameters"]["rope_theta"]
    assert sglang.ns["mamba2_state_dtype"](cfg).temporal == torch.float32
    bias_expr = keyword_expr(sglang.model, "Qwen3_5AttentionDecoderLayer", "__init__", "QKVParallelLinear", "bias")
    has_bias = eval(bias_expr, {"config": cfg, "getattr": getattr})  # noqa: S307
    assert has_bias is False  # SGLang's attention never has q/k/v biases
    if raw["qkv_bias"]:
        assert verdict["runs"] == "cannot" and "bias" in verdict["how"]
        return
    assert verdict["runs"] == "with rounding"
    # its auto dtype: float16 for a float32 checkpoint (the linearised norms cannot take it), bfloat16 for bfloat16
    assert sglang.ns["_get_and_verify_dtype"](raw, "auto") == torch.float16
    assert "only with --dtype bfloat16" in verdict["how"]
    assert sglang.ns["_get_and_verify_dtype"]({**raw, "dtype": "bfloat16"}, "auto") == torch.bfloat16


def test_each_key_the_export_writes_for_sglang_is_one_it_needs(sglang, exports):
    """The export writes full_attention_interval and a top-level partial_rotary_factor (a change to the export that
    drops either fails here), and SGLang's code needs each: without the interval it cannot place the layers, without
    the factor it rotates a quarter of each head."""
    path, _ = exports["llama", "periodic"]
    raw = json.loads((path / "config.json").read_text())
    assert raw["full_attention_interval"] == 2 and raw["partial_rotary_factor"] == 1.0
    assert sglang.TextConfig(**raw).partial_rotary_factor == 1.0
    without = sglang.TextConfig(**{k: v for k, v in raw.items() if k != "full_attention_interval"})
    with pytest.raises(AttributeError, match="full_attention_interval"):
        _ = without.layers_block_type
    without = sglang.TextConfig(**{k: v for k, v in raw.items() if k != "partial_rotary_factor"})
    assert without.partial_rotary_factor == 0.25


# -- vLLM -----------------------------------------------------------------------------------------------------

class _Recorded:
    """A rotary embedding class of vLLM's that records what get_rope builds it with."""

    def __init__(self, head_size, rotary_dim, max_position, base, is_neox_style, dtype, **kw):
        self.head_size, self.rotary_dim, self.base, self.kw = head_size, rotary_dim, base, kw


@pytest.fixture(scope="module")
def vllm():
    root = engine_files(*VLLM, VLLM_FILES)
    v = root / "vllm"
    logger = stub_module("vllm.logger", init_logger=lambda name: mock.Mock())
    platform = SimpleNamespace(is_xpu=lambda: False, is_rocm=lambda: False, is_cuda=lambda: True, is_cpu=lambda: False)
    stubs = {"vllm": stub_module("vllm"), "vllm.logger": logger,
             "vllm.platforms": stub_module("vllm.platforms", current_platform=platform),
             "vllm.utils": stub_module("vllm.utils"),
             "vllm.utils.math_utils": stub_module("vllm.utils.math_utils", round_up=lambda x, m: -(-x // m) * m)}
    hooks = import_by_path(v / "model_executor" / "models" / "config.py", "vllm_model_config_hooks", stubs)
    # get_rope with every rotary class recording its arguments (the classes hold CUDA kernels)
    pkg = "vllm_rope"
    rope_src = v / "model_executor" / "layers" / "rotary_embedding" / "__init__.py"
    import ast

    rope_stubs = {pkg: stub_module(pkg)}
    for node in ast.parse(rope_src.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            rope_stubs[f"{pkg}.{node.module}"] = stub_module(
                f"{pkg}.{node.module}", **{a.name: type(a.name, (_Recorded,), {}) for a in node.names})
    rope = import_by_path(rope_src, pkg, rope_stubs)
    ns = {"torch": torch, "ModelDType": object, "MambaDType": object, "CpuArchEnum": SimpleNamespace(POWERPC=0),
          "logger": mock.Mock(), "PreTrainedConfig": object, "ConfigFormat": object}
    definitions(v / "utils" / "torch_utils.py", ["STR_DTYPE_TO_TORCH_DTYPE", "get_kv_cache_torch_dtype"], ns)
    definitions(v / "model_executor" / "layers" / "mamba" / "mamba_utils.py", ["MambaStateDtypeCalculator"], ns)
    # a CUDA GPU of compute capability >= 8.0: vllm/platforms/cuda.py's supported_dtypes
    ns["current_platform"] = SimpleNamespace(supported_dtypes=[torch.bfloat16, torch.float16, torch.float32],
                                             get_device_name=lambda: "GPU", get_device_capability=lambda: None,
                                             is_cpu=lambda: False)
    definitions(v / "config" / "model.py", ["_FLOAT16_NOT_SUPPORTED_MODELS", "_is_valid_dtype", "_resolve_auto_dtype"],
                ns)
    return SimpleNamespace(hooks=hooks, get_rope=rope.get_rope, ns=ns, root=v)


def gdn_prefill_backend(vllm, hf_config, capability: int, requested: str = "auto") -> str:
    """vLLM's GDN prefill backend for this config on a CUDA GPU of ``capability`` (90: Hopper, 100: Blackwell)."""
    family = capability // 10 * 10
    platform = SimpleNamespace(is_xpu=lambda: False, is_rocm=lambda: False, is_cuda=lambda: True,
                               is_device_capability=lambda c: c == capability,
                               is_device_capability_family=lambda f: f == family,
                               get_cuda_runtime_major=lambda: 13, device_name="cuda")
    ns = {"current_platform": platform, "rocm_aiter_ops": mock.Mock(), "Literal": object, "VllmConfig": object}
    definitions(vllm.root / "model_executor" / "layers" / "mamba" / "gdn" / "qwen_gdn_linear_attn.py",
                ["_resolve_gdn_prefill_backend"], ns)
    cfg = SimpleNamespace(additional_config={"gdn_prefill_backend": requested},
                          model_config=SimpleNamespace(hf_text_config=hf_config))
    return ns["_resolve_gdn_prefill_backend"](cfg)[1]


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_reads_the_export(vllm, exports, family, placement):
    from transformers import AutoConfig

    path, record = exports[family, placement]
    raw = json.loads((path / "config.json").read_text())
    cfg = AutoConfig.from_pretrained(path)  # vLLM's hf_text_config for a text-only Qwen3_5ForCausalLM
    assert cfg.layer_types == raw["layer_types"]  # vLLM places layers by layer_types: any placement runs
    verdict = engine_verdict(record, "vLLM")
    qwen3_next = vllm.root / "model_executor" / "models" / "qwen3_next.py"
    env = {"config": cfg, "getattr": getattr}
    qkv_bias = eval(keyword_expr(qwen3_next, "Qwen3NextAttention", "__init__", "QKVParallelLinear", "bias"), env)  # noqa: S307
    o_bias = eval(keyword_expr(qwen3_next, "Qwen3NextAttention", "__init__", "RowParallelLinear", "bias"), env)  # noqa: S307
    gate = eval(assigned_expr(qwen3_next, "Qwen3NextAttention", "__init__", "attn_output_gate"), env)  # noqa: S307
    has_bias = any(k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) for k in _tensor_names(path))
    assert qkv_bias == has_bias == (family == "qwen2")  # vLLM builds the biases the checkpoint carries
    assert o_bias is False and gate is True and verdict["runs"] == "with rounding"
    # its Qwen3.5 hook: the GDN state dtype from the config, the M-RoPE fields dropped for text
    vcfg = SimpleNamespace(model_config=SimpleNamespace(hf_text_config=cfg),
                           cache_config=SimpleNamespace(mamba_ssm_cache_dtype="auto", mamba_cache_dtype="auto"))
    vllm.hooks.Qwen3_5ForCausalLMConfig.verify_and_update_config(vcfg)
    assert vcfg.cache_config.mamba_ssm_cache_dtype == "float32"
    conv, state = vllm.ns["MambaStateDtypeCalculator"].gated_delta_net_state_dtype(torch.bfloat16, "auto", "float32")
    assert (conv, state) == (torch.bfloat16, torch.float32)
    rotary = vllm.get_rope(head_size=cfg.head_dim, max_position=cfg.max_position_embeddings,
                           rope_parameters=cfg.rope_parameters, dtype=torch.bfloat16)
    assert type(rotary).__name__ == "RotaryEmbedding"  # plain RoPE once the M-RoPE fields are gone
    assert rotary.rotary_dim == cfg.head_dim and rotary.base == raw["rope_parameters"]["rope_theta"]
    # its auto dtype for the float32 file: bfloat16
    assert vllm.ns["_resolve_auto_dtype"](cfg.model_type, cfg.dtype, is_pooling_model=False) == torch.bfloat16
    assert "bfloat16 by default" in verdict["how"]
    # float16 flushes the linearised q/k norms of a teacher without its own (Qwen3 has its own)
    assert ("never --dtype half" in verdict["how"]) == (family != "qwen3")
    # GDN head size 16 (not 128): FlashInfer's prefill on Hopper, Triton elsewhere; the table says how to avoid it
    assert gdn_prefill_backend(vllm, cfg, 90) == "flashinfer"
    assert gdn_prefill_backend(vllm, cfg, 100) == "triton"
    assert gdn_prefill_backend(vllm, cfg, 90, requested="triton") == "triton"
    assert "--gdn-prefill-backend triton" in verdict["how"]


def test_the_qkv_bias_key_the_export_writes_is_what_gives_vllm_the_biases(vllm, exports):
    """A Qwen2 hybrid's export says qkv_bias (a change to the export that drops it fails here), and vLLM's attention
    reads that key alone: without it, no q/k/v bias parameters, and its weight loader would skip the checkpoint's."""
    from transformers import AutoConfig

    path, _ = exports["qwen2", "periodic"]
    raw = json.loads((path / "config.json").read_text())
    assert raw["qkv_bias"] is True
    expr = keyword_expr(vllm.root / "model_executor" / "models" / "qwen3_next.py", "Qwen3NextAttention", "__init__",
                        "QKVParallelLinear", "bias")
    assert eval(expr, {"config": AutoConfig.from_pretrained(path), "getattr": getattr}) is True  # noqa: S307
    without = {k: v for k, v in raw.items() if k != "qkv_bias"}
    cfg = AutoConfig.for_model(without.pop("model_type"), **without)
    assert cfg.attention_bias is True  # the teacher's own key says so, and vLLM does not read it
    assert eval(expr, {"config": cfg, "getattr": getattr}) is False  # noqa: S307


def _tensor_names(path):
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return list(f.keys())
