"""The init registry: typed specs, listed without torch, extensible with register_init."""
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import assert_close, tiny_teacher

import tcal
from tcal.conversion.apply_init import initialise
from tcal.conversion.convert import convert_with_record
from tcal.conversion.inits import INITS, InitSpec, get_init, parse_inits, register_init
from tcal.conversion.surgery import build_hybrid
from tcal.taylor.phase2 import AlignConfig
from tcal.taylor.pipeline import Calibration
from tcal.utils.errors import TcalError

KEEP = [0, 2]

# name -> (calibrated, phase1, phase2, zero_gate, align, kl)
BUILTINS = {
    "copy": (False, None, False, False, "local", False),
    "zero-gate": (False, None, False, True, "local", False),
    "phase1": (True, "reference", False, False, "local", False),
    "phase1-exact": (True, "exact", False, False, "local", False),
    "phase2": (True, None, True, False, "local", False),
    "taylor-reference": (True, "reference", True, False, "local", False),
    "taylor": (True, "exact-silent", True, False, "local", True),
    "taylor-exact": (True, "exact", True, False, "local", False),
    "taylor-exact-silent": (True, "exact-silent", True, False, "local", False),
}


def ids(B=2, T=21, seed=1):
    return torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(seed))


def test_import_tcal_lists_every_builtin_without_torch():
    code = (
        "import json, sys\n"
        "import tcal\n"
        "specs = {n: [s.calibrated, s.phase1, s.phase2, s.zero_gate, s.align, s.kl, s.apply is None, bool(s.summary)]\n"
        "         for n, s in tcal.INITS.items()}\n"
        "assert 'torch' not in sys.modules, 'import tcal imported torch'\n"
        "print(json.dumps(specs))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    specs = json.loads(out.stdout.strip().splitlines()[-1])
    assert list(specs) == list(BUILTINS)
    for name, fields in BUILTINS.items():
        assert specs[name] == [*fields, True, True], name


def test_builtin_spec_fields():
    assert tcal.INITS is INITS and tcal.InitSpec is InitSpec and tcal.register_init is register_init
    for name, fields in BUILTINS.items():
        spec = INITS[name]
        assert isinstance(spec, InitSpec) and spec.name == name and get_init(name) is spec
        assert (spec.calibrated, spec.phase1, spec.phase2, spec.zero_gate, spec.align, spec.kl, spec.apply) == (
            *fields, None), name
        assert spec.summary and "\n" not in spec.summary
    assert get_init(INITS["taylor"]) is INITS["taylor"]
    with pytest.raises(TcalError, match="unknown init 'magic'; choose one of copy, zero-gate"):
        get_init("magic")
    with pytest.raises(TcalError, match="must be calibrated=True"):
        InitSpec("bad", "Phase 1 without calibration", phase1="exact")
    with pytest.raises(TcalError, match="must be calibrated=True"):
        InitSpec("bad", "a KL stage without calibration", kl=True)
    with pytest.raises(TcalError, match="align must be one of local, sequential, residual"):
        InitSpec("bad", "unknown fit", calibrated=True, phase2=True, align="global")


def test_parse_inits():
    assert parse_inits(" copy, taylor ,") == ["copy", "taylor"]
    with pytest.raises(TcalError, match="--inits is empty"):
        parse_inits(" , ")
    with pytest.raises(TcalError, match="lists an init twice"):
        parse_inits("copy,copy")
    with pytest.raises(TcalError, match="unknown init 'magic'"):
        parse_inits("copy,magic")


@pytest.fixture
def custom_name():
    name = "test-custom-init"
    yield name
    INITS.pop(name, None)


def test_register_init_with_apply_is_used_by_convert(custom_name):
    seen = []

    def apply(hybrid, teacher, calibration):
        seen.append(calibration)
        with torch.no_grad():
            for gdn in hybrid.gdn_modules().values():
                gdn.o_proj.weight.mul_(0.5)
        return {"halved": sorted(hybrid.gdn_modules())}

    spec = register_init(InitSpec(custom_name, "copy, then W_o halved", apply=apply))
    assert INITS[custom_name] is spec and tcal.INITS[custom_name] is spec
    teacher = tiny_teacher("llama")
    hybrid = tcal.convert(teacher, keep=KEEP, init=custom_name)
    assert seen == [None] and hybrid.config.tcal_init == custom_name
    for i in (1, 3):
        assert torch.equal(hybrid.model.layers[i].self_attn.o_proj.weight,
                           0.5 * teacher.model.layers[i].self_attn.o_proj.weight)
    conv = convert_with_record(teacher, KEEP, custom_name)
    assert conv.record["init"] == custom_name and conv.record["detail"] == {"custom": {"halved": [1, 3]}}
    # a user init may be replaced (e.g. re-registered in a notebook), and a calibrated one gets the
    # teacher's activations for every converted layer
    calibrated = register_init(InitSpec(custom_name, "reads calibration", calibrated=True, apply=apply))
    assert INITS[custom_name] is calibrated
    tcal.convert(teacher, keep=KEEP, init=custom_name, calib_ids=ids(B=4, T=12))
    cal = seen[-1]
    assert isinstance(cal, Calibration) and sorted(cal.captured) == [1, 3] and cal.ids.shape == (4, 12)
    assert (cal.train_rows, cal.heldout_rows) == (slice(0, 3), slice(3, 4))


def test_builtins_cannot_be_replaced():
    for name in BUILTINS:
        with pytest.raises(TcalError, match=f"init '{name}' is a built-in baseline and cannot be replaced"):
            register_init(InitSpec(name, "an impostor"))
    assert INITS["copy"].summary.startswith("copied projections") and INITS["copy"].apply is None
    assert list(INITS)[: len(BUILTINS)] == list(BUILTINS)


def test_initialise_checks_what_an_init_needs():
    teacher = tiny_teacher("llama")
    with pytest.raises(TcalError, match="init 'taylor' needs calibration tokens"):
        initialise(build_hybrid(teacher, KEEP), teacher, "taylor")
    with pytest.raises(TcalError, match="init 'zero-gate' takes no options; got zero_wa, align"):
        initialise(build_hybrid(teacher, KEEP), teacher, "zero-gate", align=AlignConfig(), zero_wa=True)
    hybrid = build_hybrid(teacher, KEEP, target="native", output_gate=False)  # the layout always gates
    with pytest.raises(TcalError, match="needs the output gate"):
        initialise(hybrid, teacher, "zero-gate")
    hybrid = build_hybrid(teacher, KEEP)
    assert initialise(hybrid, teacher, INITS["zero-gate"]) == {}
    assert all(torch.all(g.g_proj.weight == 0) for g in hybrid.gdn_modules().values())


def test_zero_gate_equals_teacher_with_converted_attention_removed():
    teacher = tiny_teacher("llama")
    hybrid = tcal.convert(teacher, keep=KEEP, init="zero-gate")
    x = ids()
    for i in (1, 3):  # teacher with those layers' attention output zeroed
        teacher.model.layers[i].self_attn.register_forward_hook(lambda m, a, out: (torch.zeros_like(out[0]), out[1]))
    with torch.no_grad():
        assert_close(hybrid(x).logits, teacher(x).logits, 1e-5, "zero-gate hybrid vs teacher without those attentions")


def test_unknown_init_and_option():
    with pytest.raises(TcalError, match="unknown init 'magic'"):
        tcal.convert(tiny_teacher("llama"), keep=[0], init="magic")
    with pytest.raises(TcalError, match="init 'copy' takes no options; got warp_drive"):
        tcal.convert(tiny_teacher("llama"), keep=[0], warp_drive=True)
