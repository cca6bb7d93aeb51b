"""Event timeline: appends from threads and processes never interleave; spans; torn lines; the drawing."""
import subprocess
import sys
import threading
import time

import pytest

from mega_async.utils.events import (EventLog, NullEventLog, draw_run_timeline, draw_timeline, in_flight, read_events,
                               spans)

WRITER = """
import sys
from mega_async.utils.events import EventLog
log = EventLog(sys.argv[1], rank=int(sys.argv[2]))
for i in range(300):
    log.emit("train_step_start", step=i, pad="x" * 2000)
"""


def test_concurrent_appends_from_threads_and_processes(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog(path, rank=0)
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(r)]) for r in (1, 2)]
    threads = [threading.Thread(target=lambda k=k: [log.emit("episode_admitted", task=k * 1000 + i)
                                                     for i in range(200)]) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(p.wait(60) == 0 for p in procs)
    log.close()
    lines = path.read_text().splitlines()
    events = read_events(path)
    assert len(lines) == len(events) == 800 + 600  # every line whole and parseable
    assert sorted(e["task"] for e in events if e["kind"] == "episode_admitted") == sorted(
        k * 1000 + i for k in range(4) for i in range(200))
    assert {e["rank"] for e in events} == {0, 1, 2}
    assert [e["t"] for e in events] == sorted(e["t"] for e in events)


def test_span_records_failures_and_torn_lines_are_skipped(tmp_path):
    path = tmp_path / "run" / "events.jsonl"
    EventLog(path).close()
    assert not path.parent.exists()  # nothing is written before the first event
    with EventLog(path) as log:
        with log.span("sync", phase="push", version=1):
            time.sleep(0.01)
        with pytest.raises(RuntimeError):
            with log.span("sync", phase="pause"):
                raise RuntimeError("boom")
        log.child(rank=3).emit("train_step_start", step=0)
    with path.open("a") as f:
        f.write('{"t": 1.0, "kind": "trunc')  # a run killed mid-write
    ev = read_events(path)
    assert [e["kind"] for e in ev] == ["sync_start", "sync_end", "sync_start", "sync_end", "train_step_start"]
    assert ev[1]["ok"] is True and ev[1]["seconds"] >= 0.01 and ev[1]["version"] == 1
    assert ev[3]["ok"] is False and ev[4]["rank"] == 3
    s = spans(ev, "sync", ("phase",))
    assert [x["phase"] for x in s] == ["push", "pause"] and s[0]["end"] > s[0]["start"]
    log.emit("after_close")  # a closed log records nothing and does not raise
    NullEventLog().emit("x")
    with NullEventLog().span("y"):
        pass


def test_in_flight_curve():
    ev = [{"t": 1, "kind": "episode_admitted"}, {"t": 2, "kind": "episode_admitted"},
          {"t": 3, "kind": "episode_finished"}, {"t": 4, "kind": "train_step_start"}]
    assert in_flight(ev) == ([1, 2, 3], [1, 2, 1])


def test_draw_timeline_lanes(tmp_path):
    import matplotlib.image as mpimg

    path = tmp_path / "events.jsonl"
    t = 1000.0
    lines = []
    for i in range(6):
        lines += [(t + i, "episode_admitted", {}), (t + i + 3.5, "episode_finished", {"verdict": "accepted"})]
    lines += [(t + 2.5, "episode_interrupted", {}), (t + 2.6, "episode_resubmitted", {})]
    for r in (0, 1):
        lines += [(t + 4, "train_step_start", {"rank": r, "step": 0}), (t + 6, "train_step_end", {"rank": r, "step": 0})]
    lines += [(t + 6.1, "sync_start", {"phase": "push"}), (t + 6.2, "sync_start", {"phase": "update"}),
              (t + 6.9, "sync_end", {"phase": "update"}), (t + 7.0, "sync_end", {"phase": "push"})]
    import json

    path.write_text("".join(json.dumps({"t": ts, "kind": k, **f}) + "\n" for ts, k, f in lines))
    out = draw_timeline(path, tmp_path / "timeline.png")
    img = mpimg.imread(out)
    assert img.shape[0] > 300 and img.shape[1] > 1000
    green = ((img[..., 1] > 0.45) & (img[..., 0] < 0.3) & (img[..., 2] < 0.3)).sum()
    assert green > 2000  # the two training lanes are drawn
    assert draw_timeline(tmp_path / "missing.jsonl", tmp_path / "none.png") is None
    assert draw_run_timeline(tmp_path) == tmp_path / "timeline.png" and (tmp_path / "timeline.png").stat().st_size > 0


def test_end_of_run_report_draws_the_timeline(tmp_path):
    import json

    from mega_async.run.report import write_report

    rows = [{"step": i, "reward_mean": 0.1 * i, "step_s": 1.0, "elapsed_s": 1.0 + i} for i in range(3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_report(tmp_path)
    assert not (tmp_path / "timeline.png").exists()  # no events recorded: no timeline
    with EventLog(tmp_path / "events.jsonl", rank=0) as log:
        log.emit("episode_admitted", task=0)
        with log.span("train_step", step=0):
            pass
        log.emit("episode_finished", task=0, verdict="accepted")
    write_report(tmp_path)
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
