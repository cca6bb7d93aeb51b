#!/usr/bin/env bash
# One node of inference server $MA_INDEX, or the router (MA_NAME=router) (an srun task): picks a free port,
# fills __HOST__, __PORT__, __METRICS_PORT__ (a second free port), __NODE_RANK__, __DIST_INIT__ and __API_KEY__
# (from $MA_API_KEY_ENV) into the command and runs it. Node rank 0 publishes host:port in $RUN_DIR/logs/addresses/$MA_NAME only once the
# process it started (or a child of it) listens on that port (mega_async.utils.comm.listens), so the job's wait for
# /health never meets another process that took the port first. A server that ends before that and whose
# output says its port was taken (mega_async.utils.comm.lost_the_port) is started again on another port, at most
# $MA_PORT_TRIES times in all; once published, its end is the step's end, as before. A server on several
# nodes (__DIST_INIT__) is not retried: its node ranks would have to agree on the new port.
set -euo pipefail
name=${MA_NAME:-server$MA_INDEX}
label=${MA_NAME:-server $MA_INDEX}  # as the job log has always named it
host=$(scontrol show node "$SLURMD_NODENAME" 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | head -n1 | cut -d= -f2) || true
host=${host:-$SLURMD_NODENAME}
rank=${SLURM_PROCID:-0}
tries=${MA_PORT_TRIES:-5}
[ -z "${MA_DIST_INIT:-}" ] || tries=1
tail_file=$(mktemp "${TMPDIR:-/tmp}/ma_${name}_XXXXXX")  # the last lines of a try's output, read for a lost port
trap 'rm -f "$tail_file"' EXIT
pid=""
stopping=0
trap 'stopping=1; [ -z "$pid" ] || kill -TERM "$pid" 2>/dev/null || true' TERM INT  # srun signals the whole step anyway

published() {  # node rank 0: the address, once the server's own process listens on the port
  [ "$rank" = 0 ] || return 0
  "$PYTHON" -c 'import sys; from mega_async.utils.comm import listens
sys.exit(0 if listens(int(sys.argv[1]), int(sys.argv[2])) in (True, None) else 1)' "$port" "$pid" || return 1
  echo "$host:$port" >"$RUN_DIR/logs/addresses/$name.tmp"
  mv "$RUN_DIR/logs/addresses/$name.tmp" "$RUN_DIR/logs/addresses/$name"
  echo "$label listens on $host:$port (published)"
}

for ((try = 1; ; try++)); do
  ((stopping == 0)) || exit 143
  port=$("$PYTHON" -c 'from mega_async.utils.comm import free_port; print(free_port("0.0.0.0"))')
  metrics_port=""
  case "$*" in *__METRICS_PORT__*)
    metrics_port=$("$PYTHON" -c 'import sys; from mega_async.utils.comm import free_port
while (p := free_port("0.0.0.0")) == int(sys.argv[1]): pass
print(p)' "$port") ;;
  esac
  args=()
  for a in "$@"; do
    a=${a//__HOST__/$host}; a=${a//__PORT__/$port}; a=${a//__METRICS_PORT__/$metrics_port}; a=${a//__NODE_RANK__/$rank}; a=${a//__DIST_INIT__/${MA_DIST_INIT:-}}
    [ -z "${MA_API_KEY_ENV:-}" ] || a=${a//__API_KEY__/${!MA_API_KEY_ENV:-}}
    args+=("$a")
  done
  echo "$label node rank $rank on $host port $port (try $try of $tries): $*"  # the template: no API key in the log
  # its start-up limit counts from this (re)start (ma_wait_healthy reads it), not from the job's first try
  [ "$rank" != 0 ] || date +%s >"$RUN_DIR/logs/addresses/$name.started"
  # every line goes on to the step's log as before; the copier keeps the last 200 in $tail_file when the output
  # ends, and ignores SIGTERM so the server's last words still reach the log
  exec {out}> >(trap '' TERM INT; exec awk -v f="$tail_file" \
    '{ print; fflush(); last[NR % 200] = $0 } END { for (i = NR - 199; i <= NR; i++) if (i > 0) print last[i % 200] > f }')
  copier=$!
  "${args[@]}" >&"$out" 2>&1 {out}>&- &
  pid=$!
  exec {out}>&-
  up=0 polls=0
  while kill -0 "$pid" 2>/dev/null; do
    if ((up == 0 && stopping == 0)) && published; then up=1; fi
    if ((polls++ < 10)); then sleep 0.2 || true; else sleep 1 || true; fi  # quick at first, then once a second
  done
  rc=0
  wait "$pid" || rc=$?
  for ((i = 0; i < 50; i++)); do kill -0 "$copier" 2>/dev/null || break; sleep 0.1; done  # its tail, written at EOF
  ((stopping == 0)) || exit "$rc"
  if ((up == 0 && rc != 0 && try < tries)) && "$PYTHON" -c 'import sys; from mega_async.utils.comm import lost_the_port
sys.exit(0 if lost_the_port(open(sys.argv[1], errors="replace").read()) else 1)' "$tail_file"; then
    echo "$label: port $port was taken before it bound it; starting it again on another port"
    : >"$tail_file"
    continue
  fi
  exit "$rc"
done
