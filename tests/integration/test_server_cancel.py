"""Handlers cancelled by clients that give up leave nothing held: every later request is served (issue 18.4)."""
import asyncio
import time

import aiohttp
import pytest

from .conftest import get, post, run
from .server_inproc import InProcessServer


@pytest.fixture
def own_server(weights_root):
    with InProcessServer(str(weights_root / "v0"), weights_root=str(weights_root)) as s:
        yield s


async def _wait_running(addr: str, n: int, bound_s: float = 30.0) -> None:
    t0 = time.monotonic()
    while get(addr, "/server_info")[1]["num_running_reqs"] < n:
        assert time.monotonic() - t0 < bound_s, "the long request never started decoding"
        await asyncio.sleep(0.05)


def test_disk_update_whose_client_gives_up_leaves_the_server_serving(own_server, weights_root):
    """A disk update without a pause waits for a long /generate; its client times out and disconnects. Then the
    long request ends, and a new /generate and a new update must complete (the old code left the writer flag of
    its reader/writer lock set, so both hung for ever)."""
    addr = own_server.address
    long = {"input_ids": [5, 6, 7], "rid": "long-1", "sampling_params": {"max_new_tokens": 3500, "ignore_eos": True}}

    async def main() -> dict:
        async with aiohttp.ClientSession() as http:
            gen = asyncio.create_task(http.post(f"http://{addr}/generate", json=long))
            await _wait_running(addr, 1)
            with pytest.raises(asyncio.TimeoutError):
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as impatient:
                    await impatient.post(f"http://{addr}/update_weights_from_disk",
                                         json={"model_path": str(weights_root / "v1"), "weight_version": "given-up"})
            await asyncio.sleep(0.5)  # the server sees the disconnect and cancels the update's handler
            assert post(addr, "/abort_request", {"rid": "long-1"})[0] == 200
            r = await gen
            assert r.status == 200 and (await r.json())["meta_info"]["finish_reason"]["type"] == "abort"

            bounded = aiohttp.ClientTimeout(total=30)
            t0 = time.monotonic()
            async with http.post(f"http://{addr}/generate", timeout=bounded,
                                 json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}}) as r:
                out = {"generate": (r.status, len((await r.json())["output_ids"]))}
            async with http.post(f"http://{addr}/update_weights_from_disk", timeout=bounded,
                                 json={"model_path": str(weights_root / "v1"), "weight_version": "7"}) as r:
                out["update"] = (r.status, (await r.json())["success"])
            out["seconds"] = time.monotonic() - t0
            return out

    out = run(main())
    assert out["generate"] == (200, 3) and out["update"] == (200, True)
    assert get(addr, "/model_info")[1]["weight_version"] == "7"
