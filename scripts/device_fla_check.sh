#!/usr/bin/env bash
# One device call: fla equivalence tests, the CPU test suite under the device's transformers, and
# the gated-delta-rule speed table at B=4 T=4096 H=16 D=128. Needs wheels in .whl/ (see README).
# Usage (through the device tool, carry .whl):  bash scripts/device_fla_check.sh
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import torch, transformers, fla; print('torch', torch.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__, torch.cuda.get_device_name())"
python3 -m pytest tests/test_fla.py -q -s -p no:cacheprovider 2>&1 | grep -E "fla chunk|passed|failed|Error|error" | tee "$OUT/fla_tests.log"
python3 -m pytest tests/test_ops.py tests/test_gdn.py tests/test_hybrid.py -q -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/cpu_tests_on_device.log"
for dt in bfloat16 float32; do
  python3 bench/gdn_ops.py --B 4 --T 4096 --H 16 --D 128 --dtype $dt --impls chunk,fla --reps 10 --json "$OUT/gdn_ops_$dt.json" | tail -4
done
python3 bench/gdn_ops.py --B 4 --T 4096 --H 16 --D 128 --dtype float32 --impls naive --no-backward --reps 1 --warmup 0 --json "$OUT/gdn_ops_naive.json" | tail -2
