from pathlib import Path

import pytest
import yaml

from mega_async.cli import main
from mega_async.api.config import ConfigError, RunConfig
from mega_async.api.config_load import load_config, save_config

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_and_overrides():
    cfg = load_config(None, ["rollout.max_staleness=4", "trainer.lr=3e-6", "inference.addresses=[a:1,b:2]",
                             "parallel.allocation=sglang:d2+megatron:d1"])
    assert isinstance(cfg, RunConfig)
    assert cfg.rollout.max_staleness == 4 and cfg.trainer.lr == 3e-6
    assert cfg.inference.addresses == ["a:1", "b:2"]
    assert cfg.rollout.max_concurrent_rollouts is None  # the executor then uses B * (eta + 1)


def test_yaml_then_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  max_staleness: 3\n  group_size: 8\n")
    cfg = load_config(p, ["rollout.group_size=2"])
    assert (cfg.rollout.max_staleness, cfg.rollout.group_size) == (3, 2)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["rollout.max_stalenes=1"], "rollout.max_stalenes: unknown key"),
        (["nope.x=1"], "nope: unknown key"),
        (["rollout.max_staleness=abc"], "rollout.max_staleness: Value 'abc'"),
        (["rollout.dynamic_filter=maybe"], "rollout.dynamic_filter"),
        (["rollout.top_p=1.5"], "rollout.top_p=1.5 must be in (0, 1]"),
        (["rollout.max_staleness=-1"], "rollout.max_staleness=-1 must be >= 0"),
        (["rollout.group_size=1"], "rollout.dynamic_filter=true needs rollout.group_size >= 2"),
        (["algorithm.eps_clip_high=0.1"], "algorithm.eps_clip_high=0.1 must be >= algorithm.eps_clip=0.2"),
        (["inference.backend=vllm"], "inference.backend='vllm' is not one of"),
        (["trainer.ppo_n_minibatches=99"], "trainer.ppo_n_minibatches=99 exceeds rollout.consumer_batch_size"),
        (["trainer.warmup_steps=10"], "trainer.warmup_steps=10 must be < trainer.total_steps=10"),
        (["data.name=jsonl"], "data.name=jsonl needs data.path"),
        (["rollout.max_staleness"], "is not key=value"),
        (["parallel.allocation=megatron:x2"], "parallel.allocation='megatron:x2': megatron: unknown dimension 'x'"),
        (["parallel.allocation=megatron:(attn:d2p2|ffn:d4p1)"], "parallel.allocation='megatron:(attn:d2p2|ffn:d4p1)'"),
        (["inference.radix_cache=true", "inference.extra_args=[--disable-radix-cache]"],
         "inference.radix_cache=true and --disable-radix-cache in inference.extra_args contradict"),
        (["inference.radix_cache=maybe"], "inference.radix_cache"),
        (["inference.radix_cache=false", "inference.addresses=[h:1]"],
         "inference.radix_cache=false is for the servers the run launches; inference.addresses names servers"),
    ],
)
def test_bad_values_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as ei:
        load_config(None, overrides)
    msg = str(ei.value)
    assert needle in msg and "\n" not in msg and msg.startswith("ConfigError: ")


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)
    bad.write_text("rollout:\n  group_size: many\n")
    with pytest.raises(ConfigError, match="rollout.group_size"):
        load_config(bad)


def test_save_resolved_config(tmp_path):
    cfg = load_config(None, ["rollout.max_staleness=5"])
    out = save_config(cfg, tmp_path / "run")
    saved = yaml.safe_load(out.read_text())
    assert saved["rollout"]["max_staleness"] == 5
    assert load_config(out) == cfg  # the written file loads back to the same config


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    if "_sft" in path.stem:  # `mega-async sft` configs have their own schema (mega_async/run/sft.py)
        from mega_async.api.sft_config import load_sft_config

        load_sft_config(str(path))
    else:
        load_config(path)


def test_cli_rejects_bad_config_before_anything_starts(tmp_path, capsys):
    rc = main(["rollout", "-c", str(ROOT / "configs" / "rollout_demo.yaml"), "rollout.top_k=0",
               f"logging.root_dir={tmp_path}"])
    assert rc == 2
    assert "rollout.top_k=0" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing was written or started


def test_cli_train_refuses_a_layout_that_does_not_fit_the_model_in_one_line(tmp_path, capsys):
    """Checked before any trainer rank or server starts."""
    rc = main(["train", "-c", str(ROOT / "configs" / "tiny_cpu.yaml"), "parallel.allocation=sglang:d1+megatron:t3",
               f"logging.root_dir={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "tp=3 does not divide num_attention_heads=4" in err
    assert not any(tmp_path.iterdir())


def test_cli_missing_model_is_one_line(tmp_path, capsys):
    rc = main(["train", "-c", str(ROOT / "configs" / "tiny_cpu.yaml"), f"model.path={tmp_path / 'nope'}",
               f"logging.root_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "config.json not found" in err
    assert not (tmp_path / "runs").exists()  # no run directory left behind
    assert main(["init-weights", str(tmp_path / "nope")]) == 2
    assert "config.json not found" in capsys.readouterr().err


def test_cli_rollout_demo_runs(tmp_path, capsys):
    rc = main(["rollout", "-c", str(ROOT / "configs" / "rollout_demo.yaml"), "trainer.total_steps=3",
               f"logging.root_dir={tmp_path}"])
    assert rc == 0
    run_dir = tmp_path / "rollout_demo" / "run0"
    assert (run_dir / "config.yaml").exists()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    assert "max head staleness" in capsys.readouterr().out


def test_servers_come_from_the_allocation_alone():
    with pytest.raises(ConfigError, match="num_servers was removed"):
        load_config(None, ["inference.num_servers=2"])
    with pytest.raises(ConfigError, match="lists 1 servers but .* says 2"):
        load_config(None, ["parallel.allocation=sglang:d2+megatron:d1", "inference.addresses=[a:1]"])
    with pytest.raises(ConfigError, match="no inference part"):
        load_config(None, ["parallel.allocation=megatron:d2"])
    assert main(["train", "inference.backend=simulated"]) == 2  # nothing to update: refused in one line
    with pytest.raises(ConfigError, match="below the trainer's data-parallel size 4"):
        load_config(None, ["parallel.allocation=sglang:d1+megatron:d4", "rollout.consumer_batch_size=2"])


def test_api_key_is_never_taken_from_the_config(tmp_path, monkeypatch):
    from mega_async.api.config import api_key
    from mega_async.api.config_load import load_config, save_config

    with pytest.raises(ConfigError, match=r"inference.api_key must not be set: .*config.yaml.*MEGA_ASYNC_API_KEY"):
        load_config(None, ["inference.api_key=s3cret"])
    cfg = load_config(None, ["inference.api_key_env=MY_KEY"])
    monkeypatch.setenv("MY_KEY", "s3cret")
    assert api_key(cfg) == "s3cret"
    assert "s3cret" not in save_config(cfg, tmp_path).read_text()
    with pytest.raises(ConfigError, match="inference.api_key_env"):
        load_config(None, ["inference.api_key_env=not a name"])


def test_failure_limits_are_validated():
    for bad in ("inference.max_retries=-1", "inference.unhealthy_timeout=0", "rollout.max_consecutive_failures=0"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(None, [bad])


@pytest.mark.parametrize("overrides, match", [
    (["inference.router=nginx"], r"inference.router.*smg"),
    (["inference.router=smg", "inference.backend=simulated"], r"simulated engine has no servers"),
    (["inference.router=smg", "inference.router_address=127.0.0.1:9", "inference.addresses=[127.0.0.1:8]"],
     r"set one of the two"),
    (["inference.router_address=127.0.0.1:9"], r"give the servers behind it in inference.addresses"),
    (["inference.router_args=[--policy,round_robin]"], r"set inference.router=smg"),
    (["inference.router_bin=/usr/bin/smg"], r"set inference.router=smg"),
])
def test_router_settings_that_cannot_work_are_refused_in_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_router_settings_that_work_load():
    cfg = load_config(None, ["inference.router=smg", "inference.router_args=[--policy,cache_aware]"])
    assert cfg.inference.router == "smg" and cfg.inference.router_args == ["--policy", "cache_aware"]
    cfg = load_config(None, ["inference.addresses=[127.0.0.1:8,127.0.0.1:7]", "inference.router_address=127.0.0.1:9",
                             "parallel.allocation=sglang:d2+megatron:d1"])
    assert cfg.inference.router_address == "127.0.0.1:9"


def test_a_missing_smg_names_the_fix(tmp_path, monkeypatch):
    from mega_async.inference.router import find_smg

    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match=r"no `smg` executable on PATH.*pip install smg"):
        find_smg(None, str(tmp_path / "venv" / "bin" / "python"))
    with pytest.raises(ConfigError, match=r"inference.router_bin='/nope/smg' is not an executable file"):
        find_smg("/nope/smg")
    beside = tmp_path / "venv" / "bin"
    beside.mkdir(parents=True)
    (beside / "smg").write_text("#!/bin/sh\n")
    (beside / "smg").chmod(0o755)
    assert find_smg(None, str(beside / "python")) == str(beside / "smg")


def test_a_run_started_router_with_an_api_key_is_refused_before_any_server_starts(tmp_path, monkeypatch):
    from mega_async.inference.service import InferenceService

    monkeypatch.setenv("MEGA_ASYNC_API_KEY", "s3cret")
    cfg = load_config(None, [f"logging.root_dir={tmp_path}", "inference.router=smg"])
    with pytest.raises(ConfigError, match=r"smg takes the servers' key only on its command line.*router_address"):
        InferenceService(cfg)
    assert not (cfg.run_dir / "server_logs").exists()  # nothing was launched


def test_activation_recompute_settings():
    from mega_async.api.config import TrainerConfig

    assert TrainerConfig().recompute_options() == {}
    full = TrainerConfig(recompute="full", recompute_num_layers=2)
    full.validate()
    assert full.recompute_options() == {"recompute_granularity": "full", "recompute_method": "uniform",
                                        "recompute_num_layers": 2}
    sel = TrainerConfig(recompute="selective", recompute_modules=["core_attn", "layernorm"])
    sel.validate()
    assert sel.recompute_options() == {"recompute_granularity": "selective",
                                       "recompute_modules": ["core_attn", "layernorm"]}
    for bad, match in ((dict(recompute="some"), "trainer.recompute"),
                       (dict(recompute="selective", recompute_modules=["attention"]), "recompute_modules"),
                       (dict(recompute="full", recompute_modules=["mlp"]), "read with trainer.recompute=selective"),
                       (dict(recompute_num_layers=4), "read with trainer.recompute=full only"),
                       (dict(recompute="selective", recompute_modules=[]), "recomputes nothing")):
        with pytest.raises(ConfigError, match=match):
            TrainerConfig(**bad).validate()
