#!/usr/bin/env bash
# One node of inference server $MA_INDEX, or the router (MA_NAME=router) (an srun task): picks a free port,
# fills __HOST__, __PORT__, __NODE_RANK__, __DIST_INIT__ and __API_KEY__ (from $MA_API_KEY_ENV) into the
# command, publishes host:port (node rank 0) in $RUN_DIR/logs/addresses/$MA_NAME and runs it. The port is
# free when asked for, but another process can take it before the server binds it: a server whose output
# then says so (mega_async.comm.lost_the_port) is started again on another port, at most $MA_PORT_TRIES
# times in all (the address file is rewritten, and the job's wait for /health reads it again). A server on
# several nodes (__DIST_INIT__) is not retried this way: its node ranks would have to agree on the new port.
set -euo pipefail
name=${MA_NAME:-server$MA_INDEX}
host=$(scontrol show node "$SLURMD_NODENAME" 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | head -n1 | cut -d= -f2) || true
host=${host:-$SLURMD_NODENAME}
rank=${SLURM_PROCID:-0}
tries=${MA_PORT_TRIES:-5}
[ -z "${MA_DIST_INIT:-}" ] || tries=1
head=$(mktemp "${TMPDIR:-/tmp}/ma_${name}_XXXXXX")  # the start of each try's output, read for a lost port
trap 'rm -f "$head"' EXIT
# srun signals the whole step, the server included; this shell only must not start another try after it
stopping=0
trap 'stopping=1' TERM INT
for ((try = 1; ; try++)); do
  port=$("$PYTHON" -c 'from mega_async.comm import free_port; print(free_port("0.0.0.0"))')
  args=()
  for a in "$@"; do
    a=${a//__HOST__/$host}; a=${a//__PORT__/$port}; a=${a//__NODE_RANK__/$rank}; a=${a//__DIST_INIT__/${MA_DIST_INIT:-}}
    [ -z "${MA_API_KEY_ENV:-}" ] || a=${a//__API_KEY__/${!MA_API_KEY_ENV:-}}
    args+=("$a")
  done
  echo "$name node rank $rank on $host port $port (try $try of $tries): $*"  # the template: no API key in the log
  if [ "$rank" = 0 ]; then
    echo "$host:$port" >"$RUN_DIR/logs/addresses/$name.tmp"
    mv "$RUN_DIR/logs/addresses/$name.tmp" "$RUN_DIR/logs/addresses/$name"
  fi
  # every line goes on to the step's log as before, the first 64 KiB also to $head; the copier ignores SIGTERM
  # so the server's last words still reach the log, and ends when the server's output does
  set +e
  "${args[@]}" 2>&1 | (trap '' TERM INT; exec awk -v f="$head" \
    '{ print; fflush() } n < 65536 { print > f; fflush(f); n += length($0) + 1 }')
  rc=${PIPESTATUS[0]}
  set -e
  ((stopping == 0)) || exit "$rc"
  if ((rc != 0 && try < tries)) && "$PYTHON" -c 'import sys; from mega_async.comm import lost_the_port
sys.exit(0 if lost_the_port(open(sys.argv[1], errors="replace").read()) else 1)' "$head"; then
    echo "$name: port $port was taken before it bound it; starting it again on another port"
    : >"$head"
    continue
  fi
  exit "$rc"
done
