"""Routed experts on the rollout side: the client merges SGLang's base64 rows across interruptions (rows held
from before a weight update keep their routes), trajectories carry them beside versions, batches pad them."""
import base64

import numpy as np
import pytest
import torch

from mega_async.inference.client import ServerError, merge_routed_experts
from mega_async.rollout.workflow import Trajectory, trajectory_from_response
from mega_async.algo.batch import concat_padded
from mega_async.api.types import ModelResponse


def enc(rows: np.ndarray) -> str:
    return base64.b64encode(rows.astype(np.int32).tobytes()).decode()


def test_interrupted_request_keeps_the_old_routes():
    # segment 1: prompt 3 + 2 outputs -> rows for positions 0..3; segment 2 resubmits 5 tokens, 2 more outputs
    first = np.arange(4 * 4).reshape(4, 4)
    held = merge_routed_experts(None, enc(first), total_rows=4, start=0)
    assert held.tolist() == first.tolist()
    tail = 100 + np.arange(2 * 4).reshape(2, 4)  # routed_experts_start_len=4: positions 4, 5 only
    merged = merge_routed_experts(held, enc(tail), total_rows=6, start=4)
    assert merged[:4].tolist() == first.tolist() and merged[4:].tolist() == tail.tolist()
    # a server that ignores routed_experts_start_len re-sends every row, recomputed by the new weights
    full = 200 + np.arange(6 * 4).reshape(6, 4)
    merged2 = merge_routed_experts(held, enc(full), total_rows=6, start=4)
    assert merged2[:4].tolist() == first.tolist() and merged2[4:].tolist() == full[4:].tolist()


def test_bad_routes_are_refused():
    with pytest.raises(ServerError, match="--enable-return-routed-experts"):
        merge_routed_experts(None, None, total_rows=3, start=0)
    held = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ServerError, match="not rows of 4"):
        merge_routed_experts(held, enc(np.zeros(3 * 2)), total_rows=5, start=2)
    assert merge_routed_experts(held, "", total_rows=2, start=2) is held  # nothing forwarded in the segment


def test_trajectories_carry_routes_beside_versions():
    routes = torch.arange(5 * 2, dtype=torch.int32).reshape(5, 2)  # prompt 3 + 3 outputs - 1
    resp = ModelResponse([1, 2, 3], [4, 5, 6], [-0.1] * 3, [0, 0, 1], routed_experts=routes)
    t = trajectory_from_response([1, 2, 3], resp, 1.0)
    assert t["routed_experts"].shape == (1, 6, 2) and t["routed_experts"][0, :5].equal(routes)
    assert (t["routed_experts"][0, 5] == -1).all()  # the last token never went through a forward
    short = trajectory_from_response([1], ModelResponse([1], [7], [-0.2], [1], routed_experts=torch.ones(1, 2,
                                     dtype=torch.int32)), 0.0)
    batch = concat_padded([t, short])
    assert batch["routed_experts"].shape == (2, 6, 2) and (batch["routed_experts"][1, 1:] == -1).all()
    assert batch["versions"].shape == (2, 6)


def test_multi_turn_trajectory_keeps_earlier_turns_routes():
    traj = Trajectory([1, 2])
    traj.add_output(ModelResponse([1, 2], [3], [-0.1], [0], routed_experts=torch.zeros(2, 2, dtype=torch.int32)))
    traj.add_context([9])
    # the next turn's response recomputes rows 0..1 under new weights and adds rows 2..3
    traj.add_output(ModelResponse([1, 2, 3, 9], [4], [-0.1], [1], routed_experts=torch.ones(4, 2, dtype=torch.int32)))
    r = traj.tensors(1.0)["routed_experts"][0]
    assert r.shape == (5, 2) and (r[:2] == 0).all() and (r[2:4] == 1).all() and (r[4] == -1).all()


def test_journal_keeps_routes_through_copies_and_checkpoints():
    """The executor's journal hands workflows a copy of each response and snapshots running ones: both keep
    the routes (a copy without them made every routing-replay batch lack routed_experts)."""
    import asyncio

    from mega_async.rollout.journal import CallRecord, EpisodeJournal, JournaledEngine
    from mega_async.api.types import ModelRequest

    class Engine:
        async def agenerate(self, req, resume=None):
            resp = resume if resume is not None else ModelResponse(list(req.input_ids))
            resp.output_tokens, resp.output_logprobs, resp.output_versions = [7, 8], [-0.1, -0.2], [0, 0]
            resp.routed_experts = torch.arange(3 * 2, dtype=torch.int32).reshape(3, 2)
            return resp

    journal = EpisodeJournal()
    out = asyncio.run(JournaledEngine(Engine(), journal).agenerate(ModelRequest([1, 2], max_new_tokens=2)))
    assert out.routed_experts.equal(torch.arange(6, dtype=torch.int32).reshape(3, 2))
    back = CallRecord.restore(journal.records[0].snapshot())
    assert back.response.routed_experts.equal(out.routed_experts)


def test_routes_need_servers_that_return_them():
    from mega_async.api.config import ConfigError
    from mega_async.api.config_load import load_config

    for key in ("algorithm.routing_replay=true", "rollout.return_routed_experts=true"):
        with pytest.raises(ConfigError, match="inference.backend=simulated has none"):
            load_config(None, [key, "inference.backend=simulated"])
    cfg = load_config(None, ["algorithm.routing_replay=true"])
    from mega_async.inference.servers import run_server_spec

    def extra(c):
        return run_server_spec(c, num_servers=1, host="h", tp=1, ep=1).extra_args

    assert "--enable-return-routed-experts" in extra(cfg)  # servers the run launches return them
    assert "--enable-return-routed-experts" not in extra(load_config(None, []))
