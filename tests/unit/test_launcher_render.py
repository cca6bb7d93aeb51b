"""`mega-async launch slurm --dry-run`: the recipes validate and render (allocation fits the model, servers
fit the GPUs), the script is valid bash with the right steps; CPU differences come from the config alone."""
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mega_async.cli import main
from mega_async.api.config import TrainerConfig

ROOT = Path(__file__).resolve().parents[2]
RECIPES = {"qwen3_30b_a3b_gsm8k_2x8.yaml": (2, 8), "qwen3_235b_a22b_gsm8k_10x8.yaml": (10, 8)}


def dry_run(capsys, config, *args):
    rc = main(["launch", "slurm", "-c", str(ROOT / "configs" / config), "--dry-run", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err.strip()


def bash_ok(script: str, tmp_path: Path) -> None:
    f = tmp_path / "job.sbatch"
    f.write_text(script)
    r = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipes_validate_and_render(capsys, tmp_path, recipe):
    nodes, gpus = RECIPES[recipe]
    rc, script, err = dry_run(capsys, recipe)
    assert rc == 0, err
    bash_ok(script, tmp_path)
    assert f"#SBATCH --nodes={nodes}" in script and f"#SBATCH --gpus-per-node={gpus}" in script
    assert "#SBATCH --signal=B:USR1@300" in script and "#SBATCH --exclusive" in script and "#SBATCH --mem=0" in script
    servers = re.findall(r"^ma_start (server\d+) .*--nodes=(\d+)", script, re.M)
    assert servers and all(n == "1" for _, n in servers)  # one node each, tp 8
    for line in re.findall(r"sglang\.launch_server .*", script):
        assert "--tp-size 8" in line and "--ep-size 8" in line and "--enable-dp-attention" in line
        assert "--dp-size 2" in line and "--host __HOST__ --port __PORT__" in line
    assert "sglang_router" not in script and "ma_start router" not in script  # inference.router=none: none
    rc, script, err = dry_run(capsys, recipe, "inference.router=smg", "inference.router_args=[--policy,round_robin]")
    assert rc == 0, err
    bash_ok(script, tmp_path)
    # smg, its port picked on its node by server.sh, waited for like a server's, its address handed to the trainer
    assert re.search(r'env MA_NAME=router bash "\$LAUNCH_DIR/server.sh" smg launch --host __HOST__ --port __PORT__ '
                     r'--worker-urls "\$\{WORKER_URLS\[@\]\}" --log-level warn --prometheus-port __METRICS_PORT__ '
                     r'--prometheus-host __HOST__ --policy round_robin', script)  # its metrics on a port of its own
    assert 'ma_wait_healthy router "$STARTUP_TIMEOUT"' in script
    rc, own, err = dry_run(capsys, recipe, "inference.router=smg", "inference.router_args=[--prometheus-port=9100]")
    assert rc == 0 and "--prometheus-port=9100" in own and "__METRICS_PORT__" not in own, err  # the user's port kept
    assert 'ROUTER_ARGS=(inference.router=none "inference.router_address=$ADDR"' in script
    assert '"${ROUTER_ARGS[@]}"' in script and "sglang_router" not in script
    assert "unset MASTER_PORT" in script and "MEGA_ASYNC_MASTER_PORT_FILE=" in script
    assert f"TRAINER_FIRST_NODE={len(servers)}" in script and f"TRAINER_TASKS_PER_NODE={gpus}" in script


def test_a_server_spanning_nodes(capsys, tmp_path):
    rc, script, err = dry_run(capsys, "qwen3_30b_a3b_gsm8k_2x8.yaml", "--nodes", "3",
                              "parallel.allocation=sglang:d1t16e16+megatron:d8e8")
    assert rc == 0, err
    bash_ok(script, tmp_path)
    assert "--nodes=2 --ntasks=2 --ntasks-per-node=1" in script
    assert "--nnodes 2 --node-rank __NODE_RANK__ --dist-init-addr __DIST_INIT__" in script
    assert 'DIST_INIT0="$(ma_node_addr "${NODES[0]}"):$(ma_free_port "${NODES[0]}")"' in script
    assert "--dp-size 4" in script and "TRAINER_FIRST_NODE=2" in script


def test_cpu_config_asks_for_no_gpus(capsys, tmp_path):
    rc, script, err = dry_run(capsys, "gsm8k_tiny_cpu.yaml", "--nodes", "1", "--gpus-per-node", "2")
    assert rc == 0, err
    bash_ok(script, tmp_path)
    assert "--gpus-per-node" not in script and "--gres" not in script and "--exclusive" not in script
    assert "--mem=0" not in script
    assert "mega_async.server --model" in script and "sglang" not in script.split("set -uo")[1]
    assert "TRAINER_RANKS=1" in script and "--no-requeue" in script


def test_the_radix_cache_setting_reaches_slurm_servers(capsys):
    """inference.radix_cache is passed to the servers the job script starts, as to those a run starts."""
    lines = {}
    for radix in ("null", "true"):
        rc, script, err = dry_run(capsys, "qwen3_30b_a3b_gsm8k_2x8.yaml", f"inference.radix_cache={radix}")
        assert rc == 0, err
        lines[radix] = re.findall(r"sglang\.launch_server .*", script)
    assert lines["null"] and all("--disable-radix-cache" in x for x in lines["null"])
    assert lines["true"] and not any("--disable-radix-cache" in x for x in lines["true"])
    assert "inference.radix_cache=null" in script  # the trainer, given the job's servers, is not refused


@pytest.mark.parametrize("args,message", [
    (["--nodes", "3"], "takes 2 nodes of 8 GPUs (1 for 1 server(s), 1 for the trainer) but --nodes=3"),
    (["launch.gpu_memory_gib=80"], "pipeline stage 0 needs 90.5 GiB a GPU (state 71.5, activations 19.0), over 90% of a 80 GiB"),
    (["parallel.allocation=sglang:d1t8e8+megatron:d8e8t3"], "tp=3 does not divide num_attention_heads=32"),
    (["inference.addresses=[h:1]"], "inference.addresses is set: the job starts its own servers"),
    (["launch.time=soon"], "launch.time='soon' is not a Slurm time limit"),
])
def test_what_does_not_fit_is_one_line_and_prints_no_script(capsys, args, message):
    rc, script, err = dry_run(capsys, "qwen3_30b_a3b_gsm8k_2x8.yaml", *args)
    assert rc == 2 and script == "" and "\n" not in err and message in err


def test_requeue_follows_the_resume_path(capsys):
    rc, script, err = dry_run(capsys, "gsm8k_tiny_cpu.yaml", "--nodes", "1", "--gpus-per-node", "2", "--requeue")
    if "resume" in {f.name for f in dataclasses.fields(TrainerConfig)}:
        assert rc == 0 and "#SBATCH --requeue" in script and "REQUEUE=1" in script
    else:  # no resume path yet: refused before anything is submitted
        assert rc == 2 and "--requeue resumes through trainer.resume" in err


def test_submit_refuses_before_sbatch(tmp_path, capsys):
    """Checked before anything is submitted: a run directory holding another run, a GPU card without weights."""
    run = tmp_path / "runs" / "gsm8k_tiny_cpu" / "run0"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    rc = main(["launch", "slurm", "-c", str(ROOT / "configs" / "gsm8k_tiny_cpu.yaml"), "--nodes", "1",
               "--gpus-per-node", "2", f"logging.root_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "already holds a run" in err and "\n" not in err
    assert not (run / "slurm").exists()
    rc = main(["launch", "slurm", "-c", str(ROOT / "configs" / "qwen3_30b_a3b_gsm8k_2x8.yaml"),
               f"logging.root_dir={tmp_path / 'gpu'}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "has a config but no weights: download the checkpoint there" in err
    assert not (tmp_path / "gpu").exists()


def test_submit_refuses_a_run_directory_a_live_run_holds(tmp_path, capsys):
    """A run live on the directory (its driver holds run.lock): refused in one line naming the holder, before
    job.sbatch is rewritten or a job is queued (before: job.sbatch was overwritten and a doomed job submitted)."""

    run = tmp_path / "runs" / "gsm8k_tiny_cpu" / "run0"
    (run / "slurm").mkdir(parents=True)
    (run / "slurm" / "job.sbatch").write_text("#!/bin/bash\n# the live run's job\n")
    hold = ("import sys, time; from mega_async.run.lock import RunDirLock; RunDirLock.acquire(sys.argv[1]); "
            "print('held', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", hold, str(run)], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert p.stdout.readline().strip() == "held"
        rc = main(["launch", "slurm", "-c", str(ROOT / "configs" / "gsm8k_tiny_cpu.yaml"), "--nodes", "1",
                   "--gpus-per-node", "2", f"logging.root_dir={tmp_path / 'runs'}", "trainer.resume=auto"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and "is in use by another run" in err and f"pid {p.pid}" in err and "\n" not in err
        assert (run / "slurm" / "job.sbatch").read_text() == "#!/bin/bash\n# the live run's job\n"
        assert sorted(f.name for f in (run / "slurm").iterdir()) == ["job.sbatch"]
    finally:
        p.kill()
        p.wait()


def test_the_resume_hint_names_what_works_where_the_run_is(tmp_path, monkeypatch):
    """After a stop the driver says how to continue: --resume by hand, trainer.resume=auto in a Slurm job (whose
    `mega-async launch slurm` refuses --resume)."""
    from mega_async.cli import _resume_hint

    (tmp_path / "checkpoints" / "step_3").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_3" / "trainer.json").write_text("{}")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert _resume_hint(tmp_path) == "; last checkpoint step_3: continue with --resume"
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert "trainer.resume=auto" in _resume_hint(tmp_path) and "--resume" not in _resume_hint(tmp_path)


def test_both_launchers_build_one_server_command(capsys, tmp_path, monkeypatch):
    """The Slurm job's server lines come from the builder this host's launcher uses (`run_server_spec`): routing
    replay's --enable-return-routed-experts reaches the job's servers (before: the first rollout failed with
    "routed_experts were asked for but not returned"), and a server's argv is the local one with the job's
    placeholders for host, port and key."""
    from mega_async.api.config_load import load_config
    from mega_async.inference.servers import run_server_spec, server_command
    from mega_async.launch.slurm.plan import plan_job
    from mega_async.launch.slurm.render import server_argv

    recipe = "qwen3_30b_a3b_gsm8k_2x8.yaml"
    rc, script, err = dry_run(capsys, recipe, "algorithm.routing_replay=true")
    assert rc == 0, err
    lines = re.findall(r"sglang\.launch_server .*", script)
    assert lines and all("--enable-return-routed-experts" in line for line in lines)
    rc, script, err = dry_run(capsys, recipe)
    assert "--enable-return-routed-experts" not in script
    cfg = load_config(str(ROOT / "configs" / recipe), ["algorithm.routing_replay=true"])
    from transformers import AutoConfig

    plan = plan_job(cfg.allocation(), cfg.launch.nodes, cfg.launch.gpus_per_node, backend=cfg.inference.backend,
                    hf_config=AutoConfig.from_pretrained(cfg.model.path), dtype=cfg.model.dtype,
                    gpu_memory_gib=cfg.launch.gpu_memory_gib)
    s = plan.servers[0]
    local = server_command(run_server_spec(cfg, num_servers=len(plan.servers), host="__HOST__", tp=s.gpus, ep=s.ep,
                                           dp_attention=s.dp_attention,
                                           model_path=str(Path(cfg.model.path).resolve())), "__PORT__", 0)
    job = server_argv(plan, cfg, 0, tmp_path)
    assert job[: len(local)] == local, (job, local)


def test_a_server_over_several_nodes_logs_each_rank(capsys):
    rc, script, err = dry_run(capsys, "kimi_k2_gsm8k_28x8.yaml")
    assert rc == 0, err
    assert re.search(r'ma_start server0 "\$RUN_DIR/logs/server0.log" .*--nodes=2 .*'
                     r'--output="\$RUN_DIR/logs/server0.rank%t.log" --', script)
    rc, script, err = dry_run(capsys, "qwen3_30b_a3b_gsm8k_2x8.yaml")  # one node a server: one log
    assert "rank%t" not in script


@pytest.mark.parametrize("recipe, card", [("deepseek_v3_gsm8k_18x8.yaml", "deepseek-v3"),
                                          ("glm45_355b_a32b_gsm8k_10x8.yaml", "glm-4.5"),
                                          ("kimi_k2_gsm8k_28x8.yaml", "kimi-k2-instruct")])
def test_what_the_trainer_trains_of_the_mtp_layer_the_servers_serve(capsys, recipe, card):
    """A card with an MTP layer (as published: DeepSeek-V3, GLM-4.5): the recipe trains it (trainer.mtp train) and
    its servers serve it as SGLang's NEXTN draft, so every sync sends it to them; a card without (Kimi-K2): no
    draft. Never an MTP layer trained that no server uses."""
    import json

    from mega_async.api.config_load import load_config

    cfg = load_config(str(ROOT / "configs" / recipe), [])
    layers = json.loads((ROOT / "models" / card / "config.json").read_text()).get("num_nextn_predict_layers") or 0
    rc, script, err = dry_run(capsys, recipe)
    assert rc == 0, err
    lines = re.findall(r"sglang\.launch_server .*", script)
    assert lines and all(("--speculative-algorithm NEXTN" in line) == bool(layers) for line in lines)
    assert cfg.trainer.mtp == "train" and cfg.trainer.save_every_minutes > 0


def test_a_job_without_gpus_runs_real_sglang_on_its_cpu_engine(capsys, tmp_path, monkeypatch):
    """launch.device=cpu (a cluster, or CI, without GPUs): the GPU recipes' branch (inference.backend=sglang) with
    no GPUs asked for, the servers on SGLang's CPU engine (its environment's python, the CPU flags and environment
    a local run gives them)."""
    from mega_async.launch.slurm import render

    monkeypatch.setattr(render, "engine_python", lambda: "/opt/engine/bin/python")
    rc, script, err = dry_run(capsys, "gsm8k_tiny_cpu.yaml", "--nodes", "1", "--gpus-per-node", "3",
                              "inference.backend=sglang", "launch.device=cpu", "parallel.allocation=sglang:d1+megatron:d2")
    assert rc == 0, err
    bash_ok(script, tmp_path)
    assert "--gpus-per-node" not in script and "--exclusive" not in script and "--base-gpu-id" not in script
    line = re.search(r"ma_start server0 .*\n.*", script).group(0)
    assert "/opt/engine/bin/python -m sglang.launch_server" in line and "--device cpu" in line, line
    assert "SGLANG_USE_CPU_ENGINE=1" in line and "OMP_NUM_THREADS=" in line and "sglang/cpu/pythonpath" in line, line
    rc, _, err = dry_run(capsys, "gsm8k_tiny_cpu.yaml", "--nodes", "1", "--gpus-per-node", "3", "launch.device=tpu")
    assert rc != 0 and "launch.device" in err
