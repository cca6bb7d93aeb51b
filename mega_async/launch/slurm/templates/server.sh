#!/usr/bin/env bash
# One node of inference server $MA_INDEX (an srun task): picks a free port, fills __HOST__, __PORT__,
# __NODE_RANK__, __DIST_INIT__ and __API_KEY__ (from $MA_API_KEY_ENV) into the server command,
# publishes host:port (node rank 0) and runs it.
set -euo pipefail
host=$(scontrol show node "$SLURMD_NODENAME" 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | head -n1 | cut -d= -f2)
host=${host:-$SLURMD_NODENAME}
port=$("$PYTHON" -c 'from mega_async.comm import free_port; print(free_port("0.0.0.0"))')
rank=${SLURM_PROCID:-0}
args=()
for a in "$@"; do
  a=${a//__HOST__/$host}; a=${a//__PORT__/$port}; a=${a//__NODE_RANK__/$rank}; a=${a//__DIST_INIT__/${MA_DIST_INIT:-}}
  [ -z "${MA_API_KEY_ENV:-}" ] || a=${a//__API_KEY__/${!MA_API_KEY_ENV:-}}
  args+=("$a")
done
echo "server $MA_INDEX node rank $rank on $host port $port: $*"  # the template: no API key in the log
if [ "$rank" = 0 ]; then
  echo "$host:$port" >"$RUN_DIR/logs/addresses/server$MA_INDEX.tmp"
  mv "$RUN_DIR/logs/addresses/server$MA_INDEX.tmp" "$RUN_DIR/logs/addresses/server$MA_INDEX"
fi
exec "${args[@]}"
