"""tests/dist/jobs.py, the shared launch of worker scripts: a passing job, a failing one (its traceback is its
result) and the jobs after it (reported as not run, never as passed)."""
from tests.dist.jobs import run_jobs


def test_a_failing_job_ends_the_launch_and_is_reported_with_the_ones_after_it(tmp_path):
    (tmp_path / "ok.py").write_text("import sys\nprint('ok', sys.argv[1:])\n")
    (tmp_path / "bad.py").write_text("raise ValueError('boom')\n")
    (tmp_path / "exit0.py").write_text("raise SystemExit(0)\n")
    r = run_jobs(1, {"ok": [str(tmp_path / "ok.py"), "--x", "1"], "exit0": [str(tmp_path / "exit0.py")],
                     "bad": [str(tmp_path / "bad.py")], "after": [str(tmp_path / "ok.py")]}, tmp_path / "out")
    assert r["ok"] is None and r["exit0"] is None
    assert r["bad"].startswith("job bad on rank 0:") and "ValueError: boom" in r["bad"]
    assert r["after"].startswith("did not run")
