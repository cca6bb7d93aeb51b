"""End-of-run report (figures from metrics.jsonl, table, PNG) and the quiet console's routing."""
import io
import json
import logging

import pytest

from mega_async.run.console import OwnOrSevere, ProgressHandler, RunDirFileHandler, setup_logging
from mega_async.run.report import read_metrics, summarize, summary_table, time_to_reward, write_report


def history(n=4):
    """Hand-made steps: 10 groups generated and 1 s per step, 500 train tokens in 0.5 s, sync 0.1 s of 1 MB."""
    out = []
    for i in range(n):
        out.append({
            "step": i, "reward_mean": 0.25 * i, "batch_reward_mean": 0.2 * i, "elapsed_s": 2.0 + i,
            "step_s": 1.0, "rollout_wait_s": 0.3, "train_s": 0.5, "sync/push_s": 0.1, "train/tokens": 500.0,
            "sync/bytes": 1e6, "sync/total_s": 0.05, "train/staleness": 0.5,
            "executor/accepted": 8 * (i + 1), "executor/filtered": 2 * (i + 1), "executor/rejected": 0,
            "executor/failed": 0, "executor/output_tokens": 400 * (i + 1),
            "executor/consumed_staleness_0": 6 * (i + 1), "executor/consumed_staleness_1": 2 * (i + 1),
        })
    return out


def test_summary_figures_match_hand_computed():
    s = summarize(history(4), reward_threshold=0.5)
    assert s["steps"] == 4 and s["wall_s"] == 5.0
    assert s["gen_groups_per_s"] == pytest.approx(10.0)  # (40 - 10) groups over 3 s, first step left out
    assert s["gen_tokens_per_s"] == pytest.approx(400.0)
    assert s["train_tokens_per_s"] == pytest.approx(1000.0)
    assert s["sync_s"] == pytest.approx(0.1) and s["sync_bytes_per_s"] == pytest.approx(2e7)
    assert s["time_to_reward_s"] == 4.0  # reward 0.5 first reached at step 2 (elapsed 4 s)
    assert s["reward_final"] == pytest.approx((0.25 + 0.5 + 0.75) / 3)
    assert s["staleness_hist"] == {0: 24, 1: 8}
    assert s["staleness_mean"] == pytest.approx(0.25) and s["staleness_max"] == 1
    assert s["split"] == pytest.approx({"rollout_wait": 0.3, "train": 0.5, "sync": 0.1, "other": 0.1})


def test_resumed_run_sums_wall_clock_and_rates_from_the_last_process():
    first, second = history(3), history(4)
    for h in second:
        h["step"] += 3
    s = summarize(first + second)
    assert s["resumes"] == 1 and s["steps"] == 7
    assert s["wall_s"] == 4.0 + 5.0 and s["gen_groups_per_s"] == pytest.approx(10.0)
    assert s["staleness_hist"] == {0: 18 + 24, 1: 6 + 8}


def test_missing_figures_are_none_not_invented():
    h = [{k: v for k, v in r.items() if not k.startswith(("executor/output", "executor/consumed", "sync/"))}
         for r in history(3)]
    s = summarize(h)
    assert s["gen_tokens_per_s"] is None and s["sync_s"] is None and s["staleness_mean"] is None
    assert s["time_to_reward_s"] is None  # 0.8 never reached (max 0.5)
    assert "-" in summary_table(s)
    with pytest.raises(ValueError, match="no steps"):
        summarize([])


def test_time_to_reward_first_crossing():
    h = [{"reward_mean": r, "elapsed_s": t} for r, t in ((0.1, 1), (0.9, 2), (0.5, 3), (0.95, 4))]
    assert time_to_reward(h, 0.8) == 2.0 and time_to_reward(h, 0.99) is None


def test_write_report_png_and_table(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history(5)))
    png, table = write_report(tmp_path)
    data = png.read_bytes()
    assert png == tmp_path / "report.png" and data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20000
    assert "generation (groups/s)" in table and "rollout_wait 30%" in table
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 5
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["step"] == 0
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_metrics(tmp_path / "nope")


def test_a_report_that_fails_midway_leaves_the_last_whole_one(tmp_path, monkeypatch):
    """summary.json and report.png are replaced whole: a plot that fails (a full disk, a killed process) keeps the
    previous report and leaves no temporary file behind (before: summary.json was rewritten in place and a failed
    savefig left a truncated report.png)."""
    import mega_async.run.report as report

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history(5)))
    write_report(tmp_path)
    before = {n: (tmp_path / n).read_bytes() for n in ("summary.json", "report.png")}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history(7)))

    def broken(history, out, title=""):
        with open(out, "wb") as f:
            f.write(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "plot_run", broken)
    with pytest.raises(OSError, match="report.png"):
        write_report(tmp_path)
    assert (tmp_path / "report.png").read_bytes() == before["report.png"]
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 7  # written whole before the plot
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "report.png", "summary.json"]


def _record(name, level, msg="m", **extra):
    r = logging.LogRecord(name, level, __file__, 1, msg, None, None)
    r.__dict__.update(extra)
    return r


def test_console_keeps_our_info_and_drops_third_party_noise():
    f = OwnOrSevere(logging.INFO)
    assert f.filter(_record("mega_async.run.loop", logging.INFO))
    assert not f.filter(_record("megatron.core.distributed.param_and_grad_buffer", logging.INFO))
    assert not f.filter(_record("py.warnings", logging.WARNING))
    assert f.filter(_record("megatron.core", logging.ERROR))
    assert not f.filter(_record("mega_async_other", logging.INFO))  # a prefix is not our package


def test_log_file_waits_for_the_run_dir(tmp_path):
    run_dir = tmp_path / "exp" / "trial"
    h = RunDirFileHandler(run_dir)
    h.setFormatter(logging.Formatter("%(name)s %(message)s"))
    h.emit(_record("megatron.core", logging.INFO, "bucket listing"))
    assert not run_dir.exists()  # a run refused before it starts leaves no directory
    run_dir.mkdir(parents=True)
    h.emit(_record("py.warnings", logging.WARNING, "apex missing"))
    h.close()
    assert (run_dir / "train.log").read_text().splitlines() == ["megatron.core bucket listing", "py.warnings apex missing"]


def test_progress_bar_follows_steps_on_a_tty():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    h = ProgressHandler(total=5, stream=out)
    h.setFormatter(logging.Formatter("%(message)s"))
    h.emit(_record("mega_async.run.loop", logging.INFO, "step 0 done", progress_step=0))
    h.emit(_record("mega_async.run.loop", logging.INFO, "step 2 done", progress_step=2))
    assert h.bar.n == 3
    h.close()
    assert "step 2 done" in out.getvalue() and "3/5" in out.getvalue()
    plain = io.StringIO()
    p = ProgressHandler(total=5, stream=plain)  # not a terminal: plain lines, no bar
    p.setFormatter(logging.Formatter("%(message)s"))
    p.emit(_record("mega_async.run.loop", logging.INFO, "hello", progress_step=0))
    assert p.bar is None and plain.getvalue() == "hello\n"


def test_setup_logging_routes_warnings_to_the_file(tmp_path):
    import warnings

    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        handlers = setup_logging("INFO", tmp_path, total_steps=None)
        warnings.warn("Apex is not installed", UserWarning)
        logging.getLogger("megatron.core.optimizer").info("OptimizerConfig(lr=...)")
        logging.getLogger("mega_async.run.loop").info("step 0: reward 0.1")
        for h in handlers:
            h.flush()
        log = (tmp_path / "train.log").read_text()
        assert "Apex is not installed" in log and "OptimizerConfig" in log and "step 0" in log
    finally:
        logging.captureWarnings(False)
        for h in root.handlers[:]:
            root.removeHandler(h)
            h.close()
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])
