"""The bracket (`WeightSync`) and the transport it holds: the phases in their order for a push, the failure path, the
version written by the bracket alone, and a catch-up through the same phase runner (one process, a simulated
engine as the servers)."""
import pytest

from mega_async.api.types import WeightVersion
from mega_async.inference.sim.simulated import SimulatedEngine
from mega_async.trainer.sync import RolloutSide, SyncError, Transport, WeightSync


class Recording(Transport):
    """Records every call; `fail` makes that phase return an error; `behind` servers wait to be caught up."""

    catches_up = True
    sends_new_weights = False

    def __init__(self, fail=None, behind=()):
        self.calls, self.fail, self.behind = [], fail, list(behind)

    def _phase(self, name, target):
        self.calls.append((name, target, self.ctx.version.value))
        return f"{name} refused" if self.fail == name else None

    def members(self):
        self.calls.append(("members",))

    def prepare(self, target):
        self._phase("prepare", target)
        self.figures = {"export_s": 1.0}

    def begin(self, target):
        return self._phase("begin", target)

    def update(self, target):
        return self._phase("update", target)

    def commit(self, target):
        return self._phase("commit", target)

    def end(self, target):
        return self._phase("end", target)

    def abort(self):
        self.calls.append(("abort",))

    def rollback(self, targets):
        self.calls.append(("rollback",))
        return None

    def end_quietly(self):
        self.calls.append(("end_quietly",))

    def after_failure(self):
        self.calls.append(("after_failure",))

    def after_push(self):
        self.calls.append(("after_push",))

    def waiting(self):
        return bool(self.behind)

    def due(self):
        return list(self.behind)

    def rebuild(self, addresses):
        self.calls.append(("rebuild", tuple(addresses)))

    def settle(self, addresses=None):
        self.calls.append(("settle", tuple(addresses or ())))
        self.behind = []

    def close(self):
        self.calls.append(("close",))


def _sync(transport, version):
    return WeightSync([], version, RolloutSide(SimulatedEngine(version=version)), transport, timeout=10)


def test_a_push_runs_the_phases_in_order_and_only_the_bracket_moves_the_version():
    version = WeightVersion()
    t = Recording()
    sync = _sync(t, version)
    try:
        figures = sync.push()
    finally:
        sync.close()
    assert [c[0] for c in t.calls] == ["members", "prepare", "begin", "update", "commit", "end", "after_push",
                                       "close"]
    assert all(c[1:] == (1, 0) for c in t.calls[1:6])  # every phase at target 1 while the version is still 0
    assert version.value == 1 and figures["export_s"] == 1.0 and "sync/push_s" in figures


@pytest.mark.parametrize("phase", ["begin", "update", "commit", "end"])
def test_a_failed_phase_stops_the_chain_undoes_it_and_keeps_the_version(phase):
    version = WeightVersion()
    t = Recording(fail=phase)
    sync = _sync(t, version)
    try:
        label = {"begin": "begin_weight_update", "end": "end_weight_update"}.get(phase, phase)  # SGLang's routes
        with pytest.raises(SyncError, match=f"weight sync to version 1 failed \\({label}: {phase} refused\\); the "
                                            "servers keep version 0"):
            sync.push()
    finally:
        sync.close()
    names = [c[0] for c in t.calls]
    chain = ["begin", "update", "commit", "end"]
    assert names == ["members", "prepare", *chain[:chain.index(phase) + 1], "abort", "rollback", "end_quietly",
                     "after_failure", "close"]
    assert version.value == 0


def test_a_catch_up_runs_the_same_phases_at_the_current_version_over_its_own_path():
    version = WeightVersion(3)
    t = Recording(behind=["127.0.0.1:1"])
    sync = _sync(t, version)
    try:
        assert sync.catches_up and sync.catch_up_due()
        sync.catch_up()
        assert not sync.catch_up_due()
    finally:
        sync.close()
    assert [c[0] for c in t.calls] == ["rebuild", "begin", "update", "commit", "end", "settle", "close"]
    assert t.calls[0] == ("rebuild", ("127.0.0.1:1",)) and all(c[1:] == (3, 3) for c in t.calls[1:5])
    assert version.value == 3  # a catch-up brings servers to the version; it never moves it


def test_a_transport_that_does_not_catch_up_is_never_asked():
    version = WeightVersion()

    class Plain(Recording):
        catches_up = False

    t = Plain(behind=["127.0.0.1:1"])
    sync = _sync(t, version)
    try:
        assert not sync.catches_up and not sync.catch_up_due()
        sync.catch_up()
    finally:
        sync.close()
    assert [c[0] for c in t.calls] == ["close"]
