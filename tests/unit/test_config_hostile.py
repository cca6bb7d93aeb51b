"""Config files and values that are not what they seem: a "billion laughs" of YAML aliases, recursive aliases,
huge files, NaN and inf in float settings, and the SFT config's renamed key."""
import dataclasses
import logging
import time
import typing
from dataclasses import dataclass, field
from typing import Optional

import pytest

from mega_async.api import config
from mega_async.api.config import ConfigError, RunConfig
from mega_async.api.config_load import load_config
from mega_async.api.sft_config import SFTConfig, load_sft_config


def laughs(levels: int = 9, under: str = "inference:\n  extra_args: ") -> str:
    """The classic: lol1 is ten lol0s, lol2 ten lol1s, ..., lol9 = 10^9 strings in a few hundred bytes."""
    lines = ['lol0: &lol0 "lol"']
    for i in range(1, levels + 1):
        lines.append(f"lol{i}: &lol{i} [" + ", ".join([f"*lol{i - 1}"] * 10) + "]")
    return "\n".join(lines) + f"\n{under}*lol{levels}\n"


def one_line(fn, *args):
    with pytest.raises(ConfigError) as ei:
        fn(*args)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith("ConfigError: ")
    return msg


@pytest.mark.timeout(60)  # the unbounded loader builds 10^9 nodes: it would run out of memory, not finish
def test_billion_laughs_is_refused_in_one_line_at_once(tmp_path):
    p = tmp_path / "lol.yaml"
    p.write_text(laughs(9))
    assert len(p.read_bytes()) < 1000
    t0 = time.perf_counter()
    msg = one_line(load_config, p)
    assert time.perf_counter() - t0 < 0.5
    assert f"{p}:" in msg and "aliases expand to more than 100,000 values" in msg
    msg = one_line(load_sft_config, str(p))  # the SFT loader is the same loader
    assert "aliases expand" in msg
    t0 = time.perf_counter()
    bomb = "[" + ", ".join(f"&a{i} [" + ", ".join([f"*a{i - 1}" if i else "x"] * 10) + "]" for i in range(9)) + "]"
    msg = one_line(load_config, None, [f"inference.extra_args={bomb}"])  # the same on the command line
    assert time.perf_counter() - t0 < 0.5 and "override 'inference.extra_args=[&a0 [x" in msg
    assert "aliases expand to more than 100,000 values" in msg


def test_an_override_that_is_not_yaml_is_one_line():
    msg = one_line(load_config, None, ["rollout.max_staleness=[1,"])
    assert msg == "ConfigError: override 'rollout.max_staleness=[1,': invalid YAML: expected the node content, but " \
                  "found '<stream end>'; fix the value there"


def test_recursive_alias_and_huge_file_are_refused(tmp_path):
    p = tmp_path / "rec.yaml"
    p.write_text("inference:\n  extra_args: &a [x, *a]\n")
    assert "a config cannot be recursive" in one_line(load_config, p)
    p.write_text("seed: 1\n" + "#" * getattr(config, "MAX_CONFIG_BYTES", 1 << 20) + "\n")
    assert "is larger than a config file may be" in one_line(load_config, p)
    p.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    assert "nested too deeply" in one_line(load_config, p)
    p.write_text('seed: "\x01"\n')
    assert f"{p}:1:8: invalid YAML: unacceptable character" in one_line(load_config, p)


def test_ordinary_anchors_and_merge_keys_still_work(tmp_path):
    p = tmp_path / "a.yaml"
    p.write_text("rollout:\n  max_new_tokens: &n 48\n  group_size: &g 2\n  consumer_batch_size: *g\n"
                 "data:\n  max_prompt_tokens: *n\n"
                 "algorithm: &alg\n  eps_clip: 0.3\n  imp_weight_bounds: &b [0.25, 4.0]\n"
                 "launch:\n  <<: {nodes: 2, gpus_per_node: 8}\n  nodes: 3\n")
    cfg = load_config(p)
    assert (cfg.rollout.max_new_tokens, cfg.data.max_prompt_tokens) == (48, 48)
    assert (cfg.rollout.group_size, cfg.rollout.consumer_batch_size) == (2, 2)
    assert cfg.algorithm.imp_weight_bounds == [0.25, 4.0] and cfg.algorithm.eps_clip == 0.3
    assert (cfg.launch.nodes, cfg.launch.gpus_per_node) == (3, 8)


def test_the_bound_is_on_expanded_values(tmp_path):
    from mega_async.api.config_load import MAX_YAML_NODES, read_yaml

    p = tmp_path / "a.yaml"
    p.write_text(laughs(4, under="seed: 1\n#"))  # 11,111 values once expanded: under the bound
    assert read_yaml(p)["lol4"][9][9][9][9] == "lol" and MAX_YAML_NODES == 100_000
    p.write_text(laughs(5, under="seed: 1\n#"))  # 111,111
    with pytest.raises(ConfigError, match=f"{p}:6: its aliases expand to more than 100,000 values"):
        read_yaml(p)


def float_settings(schema, prefix=""):
    """Every float setting of a config (float, Optional[float], list[float]), found from its dataclasses here."""
    out, hints = [], typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        typ, args = hints[f.name], typing.get_args(hints[f.name])
        if dataclasses.is_dataclass(typ):
            out += float_settings(typ, f"{prefix}{f.name}.")
        elif typ is float or float in args or typing.get_origin(typ) is list and args == (float,):
            out.append((prefix + f.name, typing.get_origin(typ) is list, f.default))
    return out


RUN_FLOATS = float_settings(RunConfig)
SFT_FLOATS = float_settings(SFTConfig)


def test_the_float_settings_are_found():
    keys = {k for k, _, _ in RUN_FLOATS}
    assert {"rollout.temperature", "trainer.lr", "inference.request_timeout", "trainer.sync_timeout",
            "algorithm.eps_clip_high", "algorithm.imp_weight_bounds", "launch.gpu_memory_gib"} <= keys
    assert {"trainer.lr", "trainer.label_smoothing", "trainer.stop_at_accuracy"} <= {k for k, _, _ in SFT_FLOATS}


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("key, many, default", RUN_FLOATS, ids=[k for k, _, _ in RUN_FLOATS])
def test_nan_and_inf_fail_validation_for_every_float_setting(key, many, default, bad):
    value = f"[{bad}, {bad}]" if many else bad
    msg = one_line(load_config, None, [f"{key}={value}"])
    assert f"{key}{'[0]' if many else ''}={bad} is not a finite number: set a number" in msg


@pytest.mark.parametrize("key, many, default", SFT_FLOATS, ids=[k for k, _, _ in SFT_FLOATS])
def test_nan_fails_validation_for_every_sft_float_setting(key, many, default):
    msg = one_line(load_sft_config, None, [f"{key}=nan"])
    assert f"{key}=nan is not a finite number" in msg


def test_nan_in_a_file_names_the_key(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  temperature: .nan\n")
    assert one_line(load_config, p) == "ConfigError: rollout.temperature=nan is not a finite number: set a number " \
                                       "(default 1.0)"
    p.write_text("inference:\n  request_timeout: .inf\n")
    assert "inference.request_timeout=inf is not a finite number" in one_line(load_config, p)


def test_a_field_may_allow_inf_but_never_nan():
    from mega_async.api.config import check_finite

    @dataclass
    class Section:
        limit: float = field(default=1.0, metadata={"allow_inf": True})
        ratio: Optional[float] = None

    @dataclass
    class Schema:
        s: Section = field(default_factory=Section)

    check_finite(Schema(Section(limit=float("inf"))))
    with pytest.raises(ConfigError, match=r"s\.limit=nan is not a finite number"):
        check_finite(Schema(Section(limit=float("nan"))))
    with pytest.raises(ConfigError, match=r"s\.ratio=-inf is not a finite number"):
        check_finite(Schema(Section(ratio=float("-inf"))))


def test_validate_checks_a_config_built_in_code():
    cfg = RunConfig()
    cfg.trainer = dataclasses.replace(cfg.trainer, lr=float("nan"))
    with pytest.raises(ConfigError, match="trainer.lr=nan"):
        cfg.validate()


def test_sft_old_steps_name_loads_with_one_warning(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="mega_async.api.config")
    assert load_sft_config(None, ["trainer.steps=5", "trainer.warmup_steps=1"]).trainer.total_steps == 5
    warned = [r.getMessage() for r in caplog.records]
    assert warned == ["trainer.steps was renamed to trainer.total_steps: write trainer.total_steps (the old name "
                      "still loads, for now)"]
    caplog.clear()
    p = tmp_path / "old.yaml"
    p.write_text("trainer:\n  steps: 7\n  warmup_steps: 1\n")
    assert load_sft_config(str(p), ["trainer.steps=9"]).trainer.total_steps == 9  # the override still wins
    assert len(caplog.records) == 1
    caplog.clear()
    assert load_sft_config(str(p)).trainer.total_steps == 7 and len(caplog.records) == 1
    p.write_text("trainer:\n  steps: 7\n  total_steps: 8\n")
    assert "trainer.steps and trainer.total_steps are both set" in one_line(load_sft_config, str(p))
    caplog.clear()
    assert load_sft_config("configs/addition_sft_cpu.yaml").trainer.total_steps == 1300
    assert not caplog.records  # the shipped config uses the new name
