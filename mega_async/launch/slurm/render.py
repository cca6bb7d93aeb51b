"""The sbatch script of a job: the job.sbatch template (mega_async/launch/slurm/templates/, linked from launch/slurm) with the plan's header, variables and steps filled
in. Values are shell-quoted; nothing secret is written (the API key is read from its variable at run time)."""
from __future__ import annotations

import functools
import os
import shlex
import sys
from pathlib import Path
from typing import Optional, Sequence

from mega_async.api.config import RunConfig
from mega_async.inference.servers import run_server_spec, server_command, sglang_release
from mega_async.inference.sglang import cpu as sglang_cpu
from mega_async.inference.sglang.cpu import engine_python
from mega_async.launch.slurm.plan import JobPlan

LAUNCH_DIR = Path(__file__).resolve().parent / "templates"  # shipped in the package; launch/slurm links here


def _q(v: object) -> str:
    return shlex.quote(str(v))


def sbatch_header(plan: JobPlan, cfg: RunConfig, run_dir: Path, *, partition: Optional[str], time: Optional[str],
                  requeue: bool, job_name: str) -> list[str]:
    h = [f"--job-name={job_name}", f"--nodes={plan.nodes}", f"--ntasks-per-node={plan.gpus_per_node}",
         f"--output={run_dir}/logs/slurm-%j.out", f"--signal=B:USR1@{cfg.launch.preempt_signal_s}",
         "--requeue" if requeue else "--no-requeue", "--open-mode=append"]  # append: a requeued run keeps the log
    if plan.gpu:  # CPU-only runs (the embedded backend) ask for no GPUs: no --gres, no exclusive nodes
        # --mem=0: all of each node's memory (a site's default per job may be too small to load the checkpoint)
        h += [f"--gpus-per-node={plan.gpus_per_node}", "--exclusive", "--mem=0"]
    if partition:
        h.append(f"--partition={partition}")
    if time:
        h.append(f"--time={time}")
    return [f"#SBATCH {x}" for x in h]


def _cpu_engine(plan: JobPlan) -> bool:
    """Real SGLang servers on a job without GPUs (launch.device=cpu): SGLang's CPU engine."""
    return plan.backend == "sglang" and not plan.gpu


def _server_threads(plan: JobPlan) -> int:
    """CPU threads per server on a job without GPUs: a node's cores split between its servers and trainer ranks."""
    return max(1, (os.cpu_count() or 1) // (2 * len(plan.servers)))


@functools.lru_cache(maxsize=None)
def _job_release() -> Optional[str]:
    """The SGLang release of the interpreter the job runs (MEGA_ASYNC_PYTHON, else this one): the spelling of its
    flags (None: not installed here, the spelling every tested release accepts)."""
    return sglang_release(os.environ.get("MEGA_ASYNC_PYTHON", sys.executable))


def server_argv(plan: JobPlan, cfg: RunConfig, index: int, run_dir: Path) -> list[str]:
    """Server `index`'s command with __HOST__/__PORT__ (and multi-node) placeholders for server.sh."""
    s = plan.servers[index]
    embedded = plan.backend == "embedded"
    key = os.environ.get(cfg.inference.api_key_env) if getattr(cfg.inference, "api_key_env", None) else None
    cpu_engine = _cpu_engine(plan)
    spec = run_server_spec(cfg, num_servers=len(plan.servers), host="__HOST__", tp=s.gpus, ep=s.ep,
                           dp_attention=s.dp_attention, api_key="__API_KEY__" if key else None,
                           model_path=str(Path(cfg.model.path).resolve()),
                           weights_root=str(run_dir / "weights") if embedded else None,
                           num_threads=_server_threads(plan) if embedded or cpu_engine else None,
                           release=_job_release() if s.dp_attention > 1 else None,
                           device="cpu" if cpu_engine else None)
    if cpu_engine:
        spec.python = engine_python()  # the CPU engine's own environment (tools/install_sglang_cpu.sh)
    cmd = server_command(spec, "__PORT__", index)  # type: ignore[arg-type]
    if s.base_gpu and plan.gpu:
        cmd += ["--base-gpu-id", str(s.base_gpu)]
    if len(s.nodes) > 1:
        cmd += ["--nnodes", str(len(s.nodes)), "--node-rank", "__NODE_RANK__", "--dist-init-addr", "__DIST_INIT__"]
    return cmd


def _server_lines(plan: JobPlan, cfg: RunConfig, run_dir: Path) -> list[str]:
    out = []
    for s in plan.servers:
        first, k = s.nodes[0], len(s.nodes)
        env = [f"MA_INDEX={s.index}", "MA_API_KEY_ENV=" + _q(getattr(cfg.inference, "api_key_env", "") or "")]
        if _cpu_engine(plan):  # SGLang's CPU engine on, the sgl_kernel stand-in first on its path, its cores
            cpu = sglang_cpu.cpu_env({}, _server_threads(plan))
            env += [f"SGLANG_USE_CPU_ENGINE={cpu['SGLANG_USE_CPU_ENGINE']}", f"OMP_NUM_THREADS={cpu['OMP_NUM_THREADS']}",
                    f'PYTHONPATH={_q(cpu["PYTHONPATH"])}"${{PYTHONPATH:+:$PYTHONPATH}}"']
        if k > 1:
            out.append(f'DIST_INIT{s.index}="$(ma_node_addr "${{NODES[{first}]}}"):$(ma_free_port "${{NODES[{first}]}}")"')
            env.append(f'MA_DIST_INIT="$DIST_INIT{s.index}"')
        nodelist = f'"$(IFS=,; echo "${{NODES[*]:{first}:{k}}}")"'
        argv = " ".join(_q(a) for a in server_argv(plan, cfg, s.index, run_dir))
        # a server over several nodes: one log per rank (srun's %t), srun's own lines in server<i>.log
        per_rank = f' --output="$RUN_DIR/logs/server{s.index}.rank%t.log"' if k > 1 else ""
        out.append(f'ma_start server{s.index} "$RUN_DIR/logs/server{s.index}.log" "${{NODES[{first}]}}" '
                   f'--nodes={k} --ntasks={k} --ntasks-per-node=1 --nodelist={nodelist}{per_rank} -- \\\n'
                   f'  env {" ".join(env)} bash "$LAUNCH_DIR/server.sh" {argv}')
    return out


def _router_lines(plan: JobPlan, cfg: RunConfig) -> list[str]:
    """inference.router=smg: the job starts smg on the first server node in front of every server (as this host's
    launcher does for a local run), waits for it, and hands the trainer its address (ROUTER_ARGS) so rank 0
    starts none of its own. smg, not sglang_router: sglang-router drops routed experts and answers SGLang's RL
    control routes 404 (docs/inference.md)."""
    if not plan.router:
        return ['ROUTER_ARGS=()']
    first = plan.servers[0].nodes[0]
    smg = _q(cfg.inference.router_bin or "smg")
    extra = " ".join(_q(a) for a in cfg.inference.router_args)
    given = {a.split("=")[0] for a in cfg.inference.router_args}
    # smg's Prometheus metrics on a free port of its node (its default 29000 would collide with a second smg there)
    metrics = "" if "--prometheus-port" in given else " --prometheus-port __METRICS_PORT__"
    metrics += "" if "--prometheus-host" in given else " --prometheus-host __HOST__"
    return [  # through server.sh: its port picked on its node, started again if that port is taken first
        f'ROUTER_NODE=${{NODES[{first}]}}',
        'WORKER_URLS=(); for a in "${ADDRESSES[@]}"; do WORKER_URLS+=("http://$a"); done',
        'ma_start router "$RUN_DIR/logs/router.log" "$ROUTER_NODE" --nodes=1 --ntasks=1 --nodelist="$ROUTER_NODE" -- \\',
        f'  env MA_NAME=router bash "$LAUNCH_DIR/server.sh" {smg} launch --host __HOST__ --port __PORT__ '
        f'--worker-urls "${{WORKER_URLS[@]}}" --log-level warn{metrics}{" " + extra if extra else ""}',
        'ma_wait_healthy router "$STARTUP_TIMEOUT" "$SECONDS"',
        'ma_log "smg at $ADDR in front of ${#ADDRESSES[@]} servers"',
        'ROUTER_ARGS=(inference.router=none "inference.router_address=$ADDR" "inference.router_args=[]" '
        'inference.router_bin=null)',
    ]


def render_job(plan: JobPlan, cfg: RunConfig, train_args: Sequence[str], *, workdir: Path, partition: Optional[str],
               time: Optional[str], requeue: bool, template: Optional[Path] = None) -> str:
    """The complete sbatch script for `plan` (train_args: `-c CONFIG` and the user's overrides)."""
    run_dir = (workdir / cfg.run_dir).resolve()
    job_name = f"{cfg.experiment_name}-{cfg.trial_name}"
    variables = {
        "WORKDIR": workdir.resolve(), "RUN_DIR": run_dir, "LAUNCH_DIR": LAUNCH_DIR,
        "PYTHON": os.environ.get("MEGA_ASYNC_PYTHON", sys.executable), "NUM_SERVERS": len(plan.servers),
        "STARTUP_TIMEOUT": int(cfg.launch.startup_timeout), "REQUEUE": int(requeue),
        "TRAINER_FIRST_NODE": plan.trainer_nodes[0], "TRAINER_NODES": len(plan.trainer_nodes),
        "TRAINER_RANKS": plan.trainer_world, "TRAINER_TASKS_PER_NODE": plan.trainer_tasks_per_node,
    }
    var_lines = [f"{k}={_q(v)}" for k, v in variables.items()]
    var_lines.append("TRAIN_ARGS=(" + " ".join(_q(a) for a in train_args) + ")")
    text = (template or LAUNCH_DIR / "job.sbatch").read_text()
    parts = {
        "SBATCH": "\n".join(sbatch_header(plan, cfg, run_dir, partition=partition, time=time, requeue=requeue,
                                          job_name=job_name)),
        "PLAN": "\n".join(f"#   {line}" for line in plan.describe()),
        "VARS": "\n".join(var_lines),
        "SERVERS": "\n".join(_server_lines(plan, cfg, run_dir)),
        "ROUTER": "\n".join(_router_lines(plan, cfg)),
    }
    for k, v in parts.items():
        text = text.replace("{{" + k + "}}", v)
    return text
