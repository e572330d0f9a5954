#!/usr/bin/env bash
# Everything that needs a GPU, in one run under 10 minutes: the CUDA-marked tests (device
# placement, bf16 autocast, torch.compile of the reference model, FSDP2 and DTensor TP on a
# one-rank CUDA mesh, the ledger on NCCL), then bench/mfu.py (tokens/s and MFU of the ~1B
# reference model in bf16, compiled, against the chip's peak in plait.accelerators.chips).
#
#   bash bench/gpu.sh                      # uses .venv/bin/python, or $PYTHON
#   PYTHON=python3 bash bench/gpu.sh       # an environment with a CUDA build of torch
#
# Each part has its own timeout; the whole script is capped at 570 s. Results go to
# bench/results/gpu-<date>.txt. Without a CUDA device it says so and exits 1.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
OUT="bench/results/gpu-$(date -u +%Y%m%dT%H%M%SZ).txt"
export PYTHONPATH=.

if ! timeout 60 "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu.sh: no CUDA device visible to $PY (torch $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)); nothing run"
    exit 1
fi

run() {  # run <seconds> <command...>: print, time and log one part
    local limit=$1; shift
    echo "== $* (timeout ${limit}s)" | tee -a "$OUT"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$OUT"
    local rc=${PIPESTATUS[0]}
    echo "== exit $rc" | tee -a "$OUT"
    return "$rc"
}

export -f run
export OUT PY
timeout --kill-after=15 570 bash -c '
    set -uo pipefail
    status=0
    "$PY" -c "import torch; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name(0))" | tee -a "$OUT"
    run 240 "$PY" -m pytest -q -m cuda tests/ -rs -p no:cacheprovider || status=1
    run 300 "$PY" bench/mfu.py || status=1
    exit $status
'
rc=$?
echo "gpu.sh: exit $rc; log in $OUT"
exit $rc
