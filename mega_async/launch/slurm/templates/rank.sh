#!/usr/bin/env bash
# One trainer rank (an srun task, SLURM_PROCID = rank): rank 0 is the driver and logs to logs/driver.log,
# the others to logs/trainer_rank<N>.log; then `mega-async train` with the job's arguments.
set -euo pipefail
if [ "${SLURM_PROCID:-0}" = 0 ]; then log=$RUN_DIR/logs/driver.log; else log=$RUN_DIR/logs/trainer_rank$SLURM_PROCID.log; fi
exec >>"$log" 2>&1
echo "rank ${SLURM_PROCID:-0}/${SLURM_NTASKS:-1} on $(hostname) (MASTER_ADDR=$MASTER_ADDR port from rank 0 through ${MEGA_ASYNC_MASTER_PORT_FILE:-MASTER_PORT=${MASTER_PORT:-}})"
exec "$PYTHON" -m mega_async.cli train "$@"
