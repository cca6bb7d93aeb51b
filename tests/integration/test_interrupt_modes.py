"""rollout.interrupt through the sync's one pause bracket, against a real embedded server: abort (requests
return their partial output and are resubmitted), retract and in_place (the server keeps them; one HTTP
request each, tokens after the update labelled with the new version), none (the sync waits for generation
to finish: no token of the new version, nothing interrupted)."""
import asyncio
import threading
import time

import pytest

from mega_async.inference.client import SGLangClient
from mega_async.trainer.sync import reload_sync, RolloutSide
from mega_async.api.types import ModelRequest, WeightVersion

from .conftest import get, post

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place", "none"])
def test_interrupt_mode(server, weights_root, mode):
    addr = server.addresses[0]
    version = WeightVersion()
    client = SGLangClient([addr], version=version)
    sync = reload_sync(version, RolloutSide(client), str(weights_root / "v1"), timeout=120, interrupt=mode)
    reqs = [ModelRequest(input_ids=[3, 14, 15 + i], max_new_tokens=160, ignore_eos=True) for i in range(4)]
    out: dict = {}

    def generate() -> None:
        async def all_of_them():
            return await asyncio.gather(*(client.agenerate(r) for r in reqs))
        out["responses"] = asyncio.run(all_of_them())

    t = threading.Thread(target=generate)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while get(addr, "/server_info")[1]["num_running_reqs"] < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # a few tokens of version 0 in every request
        t0 = time.monotonic()
        sync.push()
        push_s = time.monotonic() - t0
        t.join(120)
        rs = out["responses"]
        assert [len(r.output_tokens) for r in rs] == [160] * 4 and all(r.stop_reason == "length" for r in rs)
        assert all(r.output_versions == sorted(r.output_versions) for r in rs)  # old tokens, then new ones
        assert get(addr, "/model_info")[1]["weight_version"] == "1" and version.value == 1
        if mode == "none":  # nothing interrupted: every request finished on the old weights before the update
            assert all(set(r.output_versions) == {0} and r.num_interruptions == 0 for r in rs)
            assert push_s > 0.1
        else:
            assert all(set(r.output_versions) == {0, 1} for r in rs)
            want = (lambda n: n >= 1) if mode == "abort" else (lambda n: n == 0)  # retract/in_place: kept server-side
            assert all(want(r.num_interruptions) for r in rs), [r.num_interruptions for r in rs]
    finally:
        t.join(120)
        sync.close()
        assert post(addr, "/update_weights_from_disk", {"model_path": str(weights_root / "v0"),
                                                        "weight_version": "0"})[0] == 200
