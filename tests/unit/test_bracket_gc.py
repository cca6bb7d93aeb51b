"""No automatic cyclic-GC pass inside the pause bracket (one full pass over a controller with tens of thousands
of episodes in flight takes seconds), and the collector is back as it was afterwards, also when the sync fails."""
import gc

import pytest

from mega_async.inference.sim.simulated import SimulatedEngine
from mega_async.trainer.sync import RolloutSide, SyncError, Transport, WeightSync
from mega_async.api.types import WeightVersion


class Probe(Transport):
    sends_new_weights = False

    def __init__(self, fail=False):
        self.fail, self.seen = fail, []

    def update(self, target):
        self.seen.append(gc.isenabled())
        return "the servers refused it" if self.fail else None


@pytest.fixture
def gc_state():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


def test_the_collector_is_off_inside_the_bracket_and_back_after(gc_state):
    gc.enable()
    version = WeightVersion()
    probe, bad = Probe(), Probe(fail=True)
    sync = WeightSync([], version, RolloutSide(SimulatedEngine(version=version)), probe, timeout=10)
    try:
        sync.push()
        assert probe.seen == [False] and gc.isenabled() and version.value == 1
        failing = WeightSync([], version, RolloutSide(SimulatedEngine(version=version)), bad, timeout=10)
        try:
            with pytest.raises(SyncError, match="the servers refused it"):
                failing.push()
        finally:
            failing.close()
        assert bad.seen == [False] and gc.isenabled() and version.value == 1
        gc.disable()  # a process that runs without the collector keeps it off
        sync.push()
        assert not gc.isenabled() and version.value == 2
    finally:
        sync.close()
