"""Which SGLang release speaks which weight-sync protocol, and the launcher's refusal of an untested one."""
import sys

import pytest

from mega_async.inference import servers
from mega_async.api.sglang_releases import Release, parse_version, untested_reason


@pytest.mark.parametrize("s, want", [("0.5.23", (0, 5, 23)), ("0.5.15.post1", (0, 5, 15)), ("v0.5.21rc0", (0, 5, 21)),
                                     ("mega_async-embedded", None), (None, None), (523, None), ("", None)])
def test_parse_version(s, want):
    assert parse_version(s) == want


def test_sessions_since_0_5_21():
    assert [Release.of(v).sessions for v in ("0.5.18", "0.5.20", "0.5.21", "0.5.23", "1.0.0")] == \
        [False, False, True, True, True]
    assert Release.of("who knows").sessions is None  # learned from the first /begin_weight_update (404: older)
    assert untested_reason("0.5.20") is None and untested_reason("0.5.23") is None
    assert "outside the tested range 0.5.18..0.5.23" in untested_reason("0.5.24")
    assert "cannot be read" in untested_reason(None)


def test_launcher_refuses_an_untested_sglang_in_one_line(monkeypatch):
    import importlib.metadata as md

    def installed(v):
        def version(name):
            if v is None:
                raise md.PackageNotFoundError(name)
            return v
        return version

    monkeypatch.setattr(servers, "engine_python", lambda: sys.executable)  # not an engine environment elsewhere
    monkeypatch.setattr(md, "version", installed("0.5.30"))
    problem = servers.untested_sglang()
    assert "SGLang 0.5.30 is outside the tested range" in problem and "allow_untested_sglang" in problem
    assert "\n" not in problem
    assert servers.untested_sglang(allow=True) is None
    with pytest.raises(RuntimeError, match="outside the tested range"):
        servers.ServerLauncher(servers.ServerSpec("sglang", "/nonexistent"))
    monkeypatch.setattr(md, "version", installed("0.5.21"))
    assert servers.untested_sglang() is None
    monkeypatch.setattr(md, "version", installed(None))
    assert "SGLang is not installed" in servers.untested_sglang()


def test_flattened_buckets_are_ordered_so_every_tensor_is_aligned():
    """Any mix of dtypes and odd sizes: in aligned_order every tensor's byte offset is a multiple of its element
    size (what SGLang 0.5.23's FlattenedTensorBucket.empty demands); the given order often is not."""
    import random

    import torch

    from mega_async.trainer.sync import aligned_order

    rng = random.Random(0)
    dtypes = [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float16, torch.int64]
    unaligned_inputs = 0
    for _ in range(200):
        ts = [torch.zeros(rng.randint(1, 7), dtype=rng.choice(dtypes)) for _ in range(rng.randint(1, 6))]

        def aligned(order):
            offset = 0
            for i in order:
                if offset % ts[i].element_size():
                    return False
                offset += ts[i].numel() * ts[i].element_size()
            return True

        order = aligned_order(ts)
        assert sorted(order) == list(range(len(ts))) and aligned(order)
        unaligned_inputs += not aligned(range(len(ts)))
    assert unaligned_inputs > 20  # the property is not vacuous


def test_dp_attention_is_spelled_as_the_servers_release_spells_it():
    """0.5.23 reads `--attn-dp-size N` (`--dp-size N --enable-dp-attention` deprecated there, removal announced for
    after 2026-12-31); 0.5.20 knows only the old spelling, which a release not known gets."""
    from mega_async.api.sglang_releases import dp_attention_args
    from mega_async.inference.servers import ServerSpec, server_command

    assert dp_attention_args("0.5.23", 8) == ["--attn-dp-size", "8"]
    assert dp_attention_args("0.5.20", 8) == dp_attention_args(None, 8) == ["--dp-size", "8", "--enable-dp-attention"]
    new = server_command(ServerSpec("sglang", "/m", tp_size=8, ep_size=8, dp_size=2, enable_dp_attention=True,
                                    release="0.5.23", python="python"), 30000)
    assert new[new.index("--attn-dp-size") + 1] == "2" and "--enable-dp-attention" not in new and "--dp-size" not in new
    old = server_command(ServerSpec("sglang", "/m", tp_size=8, ep_size=8, dp_size=2, enable_dp_attention=True,
                                    python="python"), 30000)
    assert old[old.index("--dp-size") + 1] == "2" and "--enable-dp-attention" in old
