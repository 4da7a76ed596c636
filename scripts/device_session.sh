#!/usr/bin/env bash
# tcal's GPU jobs on a machine without network (an air-gapped cluster node): docs/airgap.md.
# On a machine with network, once: tcal airgap pack (the teachers, corpora, token pools and wheels, cut into numbered
# folders under .dev/carry, each sized to travel in one transfer). Then, on the GPU machine, in the repository root,
# one job per transfer:
#   transfer some folders of .dev/carry             bash scripts/device_session.sh stage [STEP...]
#   later jobs on the same machine                  bash scripts/device_session.sh STEP...
# The steps, their settings (TEACHER, CALL_S, ...) and what each measures: python3 bench/device_jobs.py --help.
# Results land in $OUT (default /tmp/out); runs that outlive a job in $RUNS (default $STAGE/runs), resumed when
# their step runs again.
set -uo pipefail
cd "$(dirname "$0")/.."
S=${STAGE:-/tmp/tcal-stage}
export PYTHONPATH=$S/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
exec python3 bench/device_jobs.py --stage "$S" "$@"
