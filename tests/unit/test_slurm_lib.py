"""launch/slurm/lib.sh's report of a failed trainer step, sourced in bash with the logs a multi-node job
leaves: the rank that failed first is often not the driver (srun kills the driver without a word), so its
own one-line error from trainer_rank<N>.log is what the job log and the driver's log must say."""
import subprocess
from pathlib import Path

LIB = Path(__file__).resolve().parents[2] / "launch" / "slurm" / "lib.sh"


def trainer_error(tmp_path: Path, logs: dict) -> str:
    (tmp_path / "logs").mkdir()
    for name, text in logs.items():
        (tmp_path / "logs" / name).write_text(text)
    r = subprocess.run(["bash", "-c", f'source "{LIB}"; ma_trainer_error'], capture_output=True, text=True,
                       env={"RUN_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_the_failing_rank_on_another_node_is_named(tmp_path):
    out = trainer_error(tmp_path, {
        "driver.log": "rank 0/2 on n1\n[W] ProcessGroupGloo.cpp:524 Warning: Unable to resolve hostname\n",
        "trainer_rank1.log": "rank 1/2 on n2\nTraceback ...\nRuntimeError: Gloo connectFullMesh failed\n"
                             "mega-async train: rank 1: RuntimeError: Gloo connectFullMesh failed, "
                             "remote=[127.0.0.1]\n"})
    assert out == ("errors of the ranks: rank 1: RuntimeError: Gloo connectFullMesh failed, remote=[127.0.0.1] "
                   "(logs/trainer_rank1.log)")


def test_every_rank_that_said_why_in_rank_order(tmp_path):
    out = trainer_error(tmp_path, {
        "driver.log": "mega-async train: rank 0: SyncError: could not build the weight-update groups\n",
        "trainer_rank10.log": "mega-async train: rank 10: ValueError: ten\n",
        "trainer_rank2.log": "mega-async train: rank 2: ValueError: two\n"})
    assert out == ("errors of the ranks: rank 0: SyncError: could not build the weight-update groups "
                   "(logs/driver.log); rank 2: ValueError: two (logs/trainer_rank2.log); "
                   "rank 10: ValueError: ten (logs/trainer_rank10.log)")


def test_no_rank_line_falls_back_to_the_driver_log(tmp_path):
    out = trainer_error(tmp_path, {"driver.log": "step 0\nKilled\nbye\n", "trainer_rank1.log": "step 0\n"})
    assert out == "last error in logs/driver.log: Killed"
