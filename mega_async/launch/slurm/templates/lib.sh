# Shell helpers of the mega_async sbatch job (sourced by job.sbatch): components started as srun steps,
# each logging under $RUN_DIR/logs; the first to exit ends the job (no allocation left running), its
# name and last error written to the driver's log; SIGUSR1 (pre-emption) goes to the driver, SIGTERM
# stops everything.
# shellcheck shell=bash

declare -A MA_PID=() MA_LOG=() MA_NODE=()
MA_PREEMPTED=0
MA_STOPPING=0

ma_log() { echo "$(date '+%F %T') mega-async launch: $*" | tee -a "$RUN_DIR/logs/job.log" >&2; }

# the address other nodes reach a node at: its Slurm NodeAddr (falls back to the node name)
ma_node_addr() {
  local a
  a=$(scontrol show node "$1" 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | head -n1 | cut -d= -f2)
  echo "${a:-$1}"
}

ma_free_port() {  # a free TCP port on node $1 (asked on that node)
  srun --overlap --nodes=1 --ntasks=1 --nodelist="$1" "$PYTHON" -c \
    'from mega_async.utils.comm import free_port; print(free_port("0.0.0.0"))'
}

# one live run per run directory (mega_async/run/lock.py): the job holds an flock on $RUN_DIR/run.lock for its
# life (the kernel drops it when the job's last process holding it ends, however it ends); a second job on the
# directory stops here, before it writes anything. Its driver sees the lock is its own job's (slurm_job).
ma_lock_run_dir() {
  local lock=$RUN_DIR/run.lock
  mkdir -p "$RUN_DIR"
  if [ -L "$lock" ]; then
    echo "mega-async launch: $lock is a symbolic link; a run directory must hold its own files" >&2
    exit 2
  fi
  if ! command -v flock >/dev/null; then
    echo "mega-async launch: no flock(1) on $(hostname): a second job on $RUN_DIR would not be refused" >&2
    return 0
  fi
  exec {MA_LOCK_FD}<>"$lock"
  if ! flock -n "$MA_LOCK_FD"; then
    echo "mega-async launch: run directory $RUN_DIR is in use by another run ($(head -c 400 "$lock")); wait for" \
      "it to end or cancel it, or choose another trial_name" >&2
    exit 2
  fi
  printf '{"pid": %d, "host": "%s", "started": "%s", "command": "slurm job %s", "slurm_job": "%s"}\n' \
    "$$" "$(hostname)" "$(date '+%F %T %z')" "${SLURM_JOB_ID:-?}" "${SLURM_JOB_ID:-}" >"$lock"
  export MEGA_ASYNC_RUN_LOCKED=$RUN_DIR
}

ma_init() {
  ma_lock_run_dir
  mkdir -p "$RUN_DIR/logs/addresses"
  rm -f "$RUN_DIR"/logs/addresses/*
  mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  trap ma_on_usr1 USR1
  trap ma_on_term TERM INT
  ma_log "job $SLURM_JOB_ID on ${NODES[*]} (restart ${SLURM_RESTART_COUNT:-0}); logs in $RUN_DIR/logs"
}

# ma_start NAME LOG NODE SRUN_ARGS... -- CMD...: one srun step in the background
ma_start() {
  local name=$1 log=$2 node=$3; shift 3
  local srun_args=()
  while [ "$1" != "--" ]; do srun_args+=("$1"); shift; done
  shift
  srun --overlap --kill-on-bad-exit=1 "${srun_args[@]}" "$@" >>"$log" 2>&1 &
  MA_PID[$name]=$!
  MA_LOG[$name]=$log
  MA_NODE[$name]=$node
  ma_log "started $name on $node (srun pid ${MA_PID[$name]}, log ${log#"$RUN_DIR"/})"
}

ma_alive() { kill -0 "${MA_PID[$1]}" 2>/dev/null; }

# the last line of a log that looks like an error, else its last line; a server spanning nodes also writes one log
# per rank beside it (server<i>.rank<r>.log): those are read too, and the line says which
ma_last_error() {
  local line f
  for f in "$1" "${1%.log}".rank*.log; do
    [ -f "$f" ] || continue
    line=$(grep -E 'Error|error|Traceback|Killed|exited|failed|FAILED' "$f" 2>/dev/null | grep -v 'mega-async launch:' | tail -n1)
    if [ -n "$line" ]; then
      [ "$f" = "$1" ] || line="${f#"$RUN_DIR"/}: $line"
      echo "$line"
      return
    fi
  done
  line=$(grep -v '^\s*$' "$1" 2>/dev/null | tail -n1)
  echo "${line:-<empty log>}"
}

# why the trainer failed: each rank's own one-line error ("mega-async train: rank N: ...", in driver.log or
# trainer_rank<N>.log: on several nodes the rank that failed first is often not the driver, which srun
# then kills without a word), else the driver log's last error
ma_trainer_error() {
  local f line found=()
  for f in "$RUN_DIR/logs/driver.log" $(ls "$RUN_DIR"/logs/trainer_rank*.log 2>/dev/null | sort -V); do
    line=$(grep -m1 '^mega-async train: rank ' "$f" 2>/dev/null) || continue
    found+=("${line#mega-async train: } (${f#"$RUN_DIR"/})")
    ((${#found[@]} < 4)) || break
  done
  if ((${#found[@]})); then
    line=$(printf '%s; ' "${found[@]}")
    echo "errors of the ranks: ${line%; }"
  else
    echo "last error in logs/driver.log: $(ma_last_error "$RUN_DIR/logs/driver.log")"
  fi
}

# wait until component $1 wrote its address (logs/addresses/$1) and answers /health there (ADDR: that address); a
# component that exits first, or is not healthy $2 seconds after its own latest (re)start (server.sh's
# logs/addresses/$1.started; else since $3, in SECONDS), fails the job. The address is read again on every try:
# server.sh rewrites it when it starts the server again on another port
ma_wait_healthy() {
  local name=$1 timeout=$2 t0=$3 started waited
  while :; do
    ma_alive "$name" || ma_fail "$name" "exited before it became healthy"
    if [ -s "$RUN_DIR/logs/addresses/$name" ]; then
      ADDR=$(cat "$RUN_DIR/logs/addresses/$name")
      if "$PYTHON" -c 'import sys, urllib.request; urllib.request.urlopen(f"http://{sys.argv[1]}/health", timeout=2)' \
          "$ADDR" 2>/dev/null; then
        return 0
      fi
    fi
    started=$(cat "$RUN_DIR/logs/addresses/$name.started" 2>/dev/null) || started=""
    if [[ "$started" =~ ^[0-9]+$ ]]; then waited=$(($(date +%s) - started)); else waited=$((SECONDS - t0)); fi
    ((waited < timeout)) || ma_fail "$name" "not healthy ${timeout}s after it started"
    sleep 1
  done
}

# wait until every server is healthy (ADDRESSES: their addresses, in order)
ma_wait_servers() {
  local n=$1 timeout=$2 t0=$SECONDS i
  ADDRESSES=()
  for ((i = 0; i < n; i++)); do
    ma_wait_healthy "server$i" "$timeout" "$t0"
    ADDRESSES+=("$ADDR")
    ma_log "server$i healthy at $ADDR"
  done
}

ma_stop_all() {  # SIGTERM to every component still running, SIGKILL after a grace period
  local grace=${1:-60} name t0=$SECONDS
  MA_STOPPING=1
  for name in "${!MA_PID[@]}"; do ma_alive "$name" && kill -TERM "${MA_PID[$name]}" 2>/dev/null; done
  for name in "${!MA_PID[@]}"; do
    while ma_alive "$name" && ((SECONDS - t0 < grace)); do sleep 1; done
    if ma_alive "$name"; then
      ma_log "$name did not stop within ${grace}s: killed"
      kill -KILL "${MA_PID[$name]}" 2>/dev/null
    fi
    wait "${MA_PID[$name]}" 2>/dev/null
  done
}

# a component failed: say which and why in the driver's log and the job log, stop the rest, end the job
ma_fail() {
  local name=$1 why=$2
  local msg="component $name on ${MA_NODE[$name]:-?} $why; last error in ${MA_LOG[$name]#"$RUN_DIR"/}: $(ma_last_error "${MA_LOG[$name]}")"
  ma_log "$msg"
  echo "$(date '+%F %T') mega-async launch: $msg" >>"$RUN_DIR/logs/driver.log"
  ma_stop_all 60
  ma_log "job failed: $name"
  exit 1
}

ma_on_usr1() {
  MA_PREEMPTED=1
  ma_log "pre-emption signal (SIGUSR1): the driver checkpoints and stops"
  ma_alive trainer && kill -USR1 "${MA_PID[trainer]}"
}

ma_on_term() {
  ((MA_STOPPING)) && return
  ma_log "SIGTERM/SIGINT: stopping every component"
  ma_stop_all 30
  exit 143
}

# wait for the first component to exit and end the job accordingly
ma_supervise() {
  local pid rc name done_name
  while :; do
    pid=""
    wait -n -p pid "${MA_PID[@]}"
    rc=$?
    [ -n "${pid:-}" ] || continue  # a trapped signal interrupted the wait (and may leave pid unset)
    done_name=""
    for name in "${!MA_PID[@]}"; do [ "${MA_PID[$name]}" = "$pid" ] && done_name=$name; done
    [ -n "$done_name" ] || continue
    if [ "$done_name" != trainer ]; then
      ma_fail "$done_name" "exited with code $rc"
    fi
    unset "MA_PID[trainer]"
    if ((rc != 0)); then
      MA_LOG[trainer]=$RUN_DIR/logs/driver.log
      ma_log "trainer exited with code $rc; $(ma_trainer_error)"
      ma_stop_all 60
      exit "$rc"
    fi
    ma_stop_all 60
    if ((MA_PREEMPTED)) && ((REQUEUE)); then
      ma_log "pre-empted: driver checkpointed; requeueing job $SLURM_JOB_ID (it resumes with trainer.resume=auto)"
      scontrol requeue "$SLURM_JOB_ID"
    elif ((MA_PREEMPTED)); then
      ma_log "pre-empted: driver checkpointed and stopped (no --requeue)"
    else
      ma_log "training finished"
    fi
    exit 0
  done
}
