#!/usr/bin/env bash
# GPU check for a GPU machine, under 14 minutes: the GPU-marked tests, Megatron parity with the local
# and Transformer Engine specs (tools/gpu_parity.py), a Megatron MoE train-step figure (~1B active, bf16,
# random weights: tokens/s and MFU; tools/bench_gpu.py) and the GPU serving scenario (configs/bench/serve_gpu.yaml:
# real SGLang as the recipes start it, TP = EP over the GPUs, against the embedded server in the same run, gated by
# benchmarks/baselines/gpu.json). Prints one summary block; a part that cannot run says why and is skipped.
#
#   tools/gpu_check.sh                     # on the GPU machine, from the repository root
#   tools/gpu_check.sh --wheels DIR        # first install the wheels in DIR (no index), e.g. megatron-core
#   tools/gpu_check.sh --cpu-dry-run       # check the script and its Python on CPU (tiny sizes, no figures)
#
# Exit status: 0 when every part that ran passed, 1 otherwise (also where no GPU is visible, unless --cpu-dry-run). Per-part logs go to $GPU_CHECK_DIR
# (default /tmp/gpu_check); the summary block is also written there as summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
WHEELS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-dry-run) DRY=1 ;;
    --wheels) WHEELS="${2:?--wheels needs a directory}"; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (use --cpu-dry-run, --wheels DIR)" >&2; exit 2 ;;
  esac
  shift
done
LOG="${GPU_CHECK_DIR:-/tmp/gpu_check}"
mkdir -p "$LOG"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
T0=$(date +%s)
SUMMARY=()
FAILED=0

have() { "$PY" -c "import $1" >/dev/null 2>&1; }
add() { SUMMARY+=("$(printf '%-12s %-5s %s' "$1" "$2" "$3")"); [ "$2" = FAIL ] && FAILED=1; return 0; }

# run NAME LIMIT_S CMD...: the part's output to $LOG/NAME.log; its last JSON line (or last line) summarised
run() {
  local name=$1 limit=$2; shift 2
  local t=$(date +%s) rc
  timeout -k 10 "$limit" "$@" >"$LOG/$name.log" 2>&1
  rc=$?
  local last
  last=$(grep -E '^\{' "$LOG/$name.log" | tail -1)
  [ -n "$last" ] || last=$(grep -v '^\s*$' "$LOG/$name.log" | tail -1)
  local took=$(( $(date +%s) - t ))
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then add "$name" FAIL "timed out after ${limit}s (log $LOG/$name.log)"
  elif [ $rc -ne 0 ]; then add "$name" FAIL "exit $rc in ${took}s: ${last:0:300}"
  elif echo "$last" | grep -q '"skipped"'; then add "$name" SKIP "${last:0:300}"
  else add "$name" ok "${took}s: ${last:0:400}"
  fi
}

if [ -n "$WHEELS" ]; then
  "$PY" -m pip install --no-index --find-links "$WHEELS" "$WHEELS"/*.whl >"$LOG/wheels.log" 2>&1 \
    && add wheels ok "installed $(ls "$WHEELS"/*.whl | wc -l) wheel(s) from $WHEELS" \
    || add wheels FAIL "pip install from $WHEELS failed (log $LOG/wheels.log)"
fi

GPU=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" 2>/dev/null)
VERS=$("$PY" - <<'PYEOF' 2>/dev/null
from importlib import metadata
out = []
for n in ("torch", "megatron-core", "transformer-engine", "transformers", "sglang"):
    try:
        out.append(f"{n} {metadata.version(n)}")
    except metadata.PackageNotFoundError:
        out.append(f"{n} -")
print(", ".join(out))
PYEOF
)
add env info "gpu: ${GPU:-none}; $VERS; commit $(git rev-parse --short HEAD 2>/dev/null || echo ?)"

if [ $DRY -eq 1 ]; then
  run train-step 300 "$PY" tools/bench_gpu.py train-step --cpu-dry-run
  run server-gen 300 "$PY" tools/bench_gpu.py server-gen --cpu-dry-run
  add gpu-tests SKIP "--cpu-dry-run: the GPU-marked tests need a GPU"
  add parity SKIP "--cpu-dry-run: tools/gpu_parity.py needs a GPU"
elif [ -z "$GPU" ]; then  # a GPU check that checked nothing must not pass: say --cpu-dry-run to check the script
  for p in gpu-tests parity train-step server-gen; do add "$p" FAIL "no CUDA device visible to torch (on a machine \
without a GPU, run with --cpu-dry-run)"; done
else
  if have megatron.core; then
    run gpu-tests 120 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests
    if grep -q "no tests ran\|0 selected" "$LOG/gpu-tests.log"; then
      SUMMARY[-1]="$(printf '%-12s %-5s %s' gpu-tests SKIP 'no GPU-marked tests collected')"
    fi
    note="local + te specs"
    have transformer_engine || note="local spec only: transformer-engine not installed"
    run parity 100 "$PY" tools/gpu_parity.py
    SUMMARY[-1]="${SUMMARY[-1]} ($note)"
    run train-step 170 "$PY" tools/bench_gpu.py train-step
  else
    for p in gpu-tests parity train-step; do
      add "$p" SKIP "megatron-core not installed (build it here with pip wheel, pass --wheels DIR)"
    done
  fi
  # the GPU scenario through the nightly gate: against benchmarks/baselines/gpu.json, written by the first GPU run
  # that finds no serve_gpu in it (copy it back into the repository from $LOG)
  upd=""
  "$PY" -c "import json,sys; sys.exit('serve_gpu' not in json.load(open('benchmarks/baselines/gpu.json'))['scenarios'])" \
    2>/dev/null || upd="--update-baseline --baseline $LOG/gpu.json"
  run server-gen 420 "$PY" -m mega_async.cli bench serve_gpu --repeats 1 --out "$LOG/serve_gpu.json" --no-history $upd
fi

BLOCK="==== mega_async gpu_check ($(( $(date +%s) - T0 ))s$( [ $DRY -eq 1 ] && echo ', cpu dry run')) ===="
{
  echo "$BLOCK"
  printf '%s\n' "${SUMMARY[@]}"
  echo "==== $( [ $FAILED -eq 0 ] && echo PASS || echo FAIL ) ===="
} | tee "$LOG/summary.txt"
exit $FAILED
