#!/usr/bin/env bash
# Build (or reuse) the virtual environment that runs the real SGLang engine on a CPU machine.
#
#   bash tools/install_sglang_cpu.sh [VENV_DIR]     (default: $SGLANG_CPU_VENV, else /tmp/mega_async_sglang_cpu)
#
# In it: torch==2.14.1 + torchvision==0.29.1 (the releases pip finds on this machine's disk for Python 3.11),
# `sglang==0.5.23 --no-deps`, the requirements that SGLang 0.5.23's own metadata lists, with its pins, less the
# CUDA/GPU-only ones (EXCLUDED below; sgl_kernel is replaced by the project's stand-in, which the launcher puts on
# the servers' PYTHONPATH), and this project (`pip install --no-deps -e .`) for that stand-in and the server shim.
# An environment already complete for this script, this checkout and this Python is reused as it is.
# Progress goes to stderr, pip's output to VENV_DIR/.install.log; the last line on stdout is the engine's python.
# On any failure: one line on stderr naming the step, exit 1.
set -uo pipefail

SGLANG_VERSION=0.5.23
TORCH_PINS=(torch==2.14.1 torchvision==0.29.1)
SMG_VERSION=1.13.0  # the router (sglang-router's successor): forwards SGLang's fields, fans RL control calls out
# SGLang 0.5.23's requirements left out, each for a reason (names as PEP 503 normalises them)
EXCLUDED=(
  sglang-kernel            # CUDA kernels: no CPU wheel on PyPI; mega_async/inference/sglang/cpu/pythonpath/sgl_kernel
  flashinfer-python flash-attn-4 sgl-flash-mla  # GPU attention kernels
  sgl-deep-ep sgl-deep-gemm                     # GPU expert-parallel all-to-all and FP8 GEMM
  cuda-python nvshmem4py-cu13 nvidia-cutlass-dsl nvidia-mathdx nvidia-ml-py  # CUDA / NVIDIA bindings
  quack-kernels tilelang humming-kernels        # GPU kernel DSLs
  torch-memory-saver                            # releases CUDA memory
  kernels                                       # fetches compiled GPU kernels from the Hub at run time
  torchaudio                                    # pinned ==2.11.0, which requires torch 2.11: contradicts torch==2.14.1
  torch torchvision                             # installed first, with the pins above
)

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${1:-${SGLANG_CPU_VENV:-/tmp/mega_async_sglang_cpu}}
BASE_PYTHON=${PYTHON:-python3}
T0=$(date +%s)

say() { echo "install_sglang_cpu: $*" >&2; }
fail() { say "FAILED: $*"; exit 1; }

BASE_VERSION=$("$BASE_PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) \
  || fail "$BASE_PYTHON does not run: set PYTHON to a Python 3.11"
[[ "$BASE_VERSION" == 3.11 ]] \
  || fail "$BASE_PYTHON is Python $BASE_VERSION; torch 2.14.1 lies on this disk for 3.11 only: set PYTHON to a Python 3.11"
mkdir -p "$VENV" 2>/dev/null || fail "cannot create $VENV"
VENV=$(cd "$VENV" && pwd)
LOG="$VENV/.install.log"
STAMP="$VENV/.mega_async_sglang_cpu"
PY="$VENV/bin/python"

# run STEP CMD...: CMD's output appended to the log; on failure one line with its last log line
run() {
  local step=$1; shift
  echo "== $step: $*" >>"$LOG"
  if ! "$@" >>"$LOG" 2>&1; then
    fail "$step ($(grep -v '^\s*$' "$LOG" | tail -n 1 | cut -c1-240)); full log: $LOG"
  fi
}

# what makes an environment "this one": the script (pins, exclusions), the base Python, the checkout
fingerprint() {
  { sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1; "$BASE_PYTHON" -c 'import sys; print(sys.version)'; echo "$ROOT"; } \
    | sha256sum | cut -d' ' -f1
}

# the environment answers as built: sglang, torch, torchvision at their pins, mega_async from this checkout
healthy() {
  "$PY" - "$SGLANG_VERSION" "$ROOT" "${TORCH_PINS[@]}" >/dev/null 2>&1 <<'EOF'
import sys
from importlib.metadata import version
import mega_async, os
want_sglang, root, *pins = sys.argv[1:]
assert version("sglang") == want_sglang
assert version("smg") == "1.13.0"
for pin in pins:
    name, v = pin.split("==")
    assert version(name).split("+")[0] == v, pin
assert os.path.realpath(os.path.dirname(mega_async.__file__)) == os.path.realpath(os.path.join(root, "mega_async"))
EOF
}

FP=$(fingerprint)
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$FP" ]] && healthy; then
  say "reusing $VENV (complete for this script and checkout; $(($(date +%s) - T0)) s)"
  echo "$PY"
  exit 0
fi

if [[ -e "$VENV/bin" && ! -f "$VENV/pyvenv.cfg" ]]; then
  fail "$VENV holds something that is not a virtual environment: give another directory"
fi
rm -f "$STAMP"
: >"$LOG"
say "building $VENV (log: $LOG)"
[[ -x "$PY" ]] || run "create the virtual environment" "$BASE_PYTHON" -m venv "$VENV"
PIP=("$PY" -m pip --disable-pip-version-check)

say "torch + torchvision (from this machine's disk) and sglang==$SGLANG_VERSION (no dependencies)"
run "install torch" "${PIP[@]}" install "${TORCH_PINS[@]}" packaging
run "install sglang" "${PIP[@]}" install --no-deps "sglang==$SGLANG_VERSION"

# SGLang's own requirement list, read from its installed metadata: markers evaluated here, extras left out
REQS=$("$PY" - "${EXCLUDED[@]}" <<'EOF'
import re, sys
from importlib.metadata import requires
from packaging.requirements import Requirement
excluded, left_out = set(sys.argv[1:]), []
for line in requires("sglang") or []:
    req = Requirement(line)
    name = re.sub(r"[-_.]+", "-", req.name).lower()
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an extra's, or another platform's
    if name in excluded:
        left_out.append(name)
    else:
        print(line.split(";")[0].strip())
print("# " + " ".join(left_out))
EOF
) || fail "reading sglang==$SGLANG_VERSION's requirements from its metadata (see $LOG)"
mapfile -t REQ_LIST < <(grep -v '^#' <<<"$REQS")
LEFT_OUT=$(grep '^#' <<<"$REQS" | cut -c3-)
say "${#REQ_LIST[@]} of SGLang's requirements; left out: $LEFT_OUT"
echo "== requirements kept: ${REQ_LIST[*]}" >>"$LOG"
# torch's pins repeated so the resolver can never move them
run "install SGLang's requirements" "${PIP[@]}" install "${REQ_LIST[@]}" "${TORCH_PINS[@]}"

say "smg==$SMG_VERSION (SGLang's router, for multi-server runs: docs/inference.md)"
run "install smg" "${PIP[@]}" install "smg==$SMG_VERSION" "${TORCH_PINS[@]}"

say "this project (editable, no dependencies): $ROOT"
run "install mega_async" "${PIP[@]}" install --no-deps -e "$ROOT"

healthy || fail "the environment does not import sglang==$SGLANG_VERSION, ${TORCH_PINS[*]} and mega_async from $ROOT" \
  "(see $LOG)"
echo "$FP" >"$STAMP"
say "built $VENV in $(($(date +%s) - T0)) s ($(du -sh "$VENV" 2>/dev/null | cut -f1))"
echo "$PY"
