"""One version owner: readers hold a read-only view and cannot set it; the client and the simulator implement the
InferenceEngine protocol the rollout layer and the sync call (no duck typing in between)."""
import pytest

from mega_async.inference.client import SGLangClient
from mega_async.inference.sim.simulated import SimulatedEngine
from mega_async.rollout.staleness import StalenessManager
from mega_async.trainer.sync import run_version
from mega_async.api.types import InferenceEngine, VersionView, WeightVersion


def test_readers_see_the_owners_version_and_cannot_set_it():
    version = WeightVersion()
    view = version.view()
    m = StalenessManager(8, 2, 1, version=view)
    client = SGLangClient(["127.0.0.1:1"], version=view)
    sim = SimulatedEngine(version=view)
    version.set(3)
    assert (m.version, client.version, sim.version, view.value) == (3, 3, 3, 3)
    assert not hasattr(view, "set") and isinstance(view, VersionView)
    with pytest.raises(RuntimeError, match="owned by the run's weight sync"):
        m.set_version(4)
    m.on_version_recovered(3)  # the sync restored it already: only the consumed budget is set
    assert m.stats["accepted"] == 6
    with pytest.raises(RuntimeError, match="owned by the run's weight sync"):
        m.on_version_recovered(5)


def test_a_standalone_manager_owns_its_version():
    m = StalenessManager(8, 2, 1)
    m.set_version(2)
    assert m.version == 2


def test_a_run_starts_at_zero_or_one_short_of_its_checkpoint():
    assert run_version().value == 0
    assert run_version(5).value == 4  # the resume's first push brings it back to 5


@pytest.mark.parametrize("engine", [SGLangClient(["127.0.0.1:1"]), SimulatedEngine()], ids=["client", "simulator"])
def test_both_engines_implement_the_protocol(engine):
    assert isinstance(engine, InferenceEngine)
