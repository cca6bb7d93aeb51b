"""What a newcomer types first: `--help` of every command (train and sft list every setting of their typed config
with its type and default), `--version`, and one-line errors for an unknown key or a broken YAML file."""
import dataclasses
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

import mega_async
from mega_async.cli import main
from mega_async.api.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]


def run(argv, capsys):
    """(exit code, stdout, stderr) of `mega-async ARGV` in-process (argparse's --help/--version exit 0)."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def settings(schema, prefix=""):
    """(dotted key, default) of every field of every section, walked here rather than taken from the code under
    test."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from settings(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def check_lists_every_setting(schema, text):
    assert "docs/configuration.md" in text
    rows = {m[1]: m[2] for m in re.finditer(r"^ {4}(\S+) +\S.*? = (.*)$", text, re.M)}
    for key, default in settings(schema):
        assert key in rows, f"{key} missing from --help"
        assert yaml.safe_load(rows[key]) == default, f"{key}: --help says {rows[key]!r}, the default is {default!r}"
        section = key.partition(".")[0] if "." in key else "(top level)"
        assert f"\n  {section}:\n" in text


def test_train_help_lists_every_section_key_type_and_default(capsys):
    rc, out, _ = run(["train", "--help"], capsys)
    assert rc == 0
    check_lists_every_setting(RunConfig, out)
    assert re.search(r"^ {4}rollout\.max_concurrent_rollouts +int \| null = null$", out, re.M)
    assert re.search(r"^ {4}algorithm\.imp_weight_bounds +list\[float\] = \[0\.5, 5\.0\]$", out, re.M)
    rc, rollout, _ = run(["rollout", "--help"], capsys)
    assert rc == 0 and out.split("settings, as")[1] == rollout.split("settings, as")[1]  # the same RunConfig


def test_sft_help_lists_every_setting_of_the_sft_config(capsys):
    from mega_async.api.sft_config import SFTConfig

    rc, out, _ = run(["sft", "--help"], capsys)
    assert rc == 0
    check_lists_every_setting(SFTConfig, out)
    assert "trainer.total_steps" in out and "trainer.steps " not in out


def test_version_has_one_source(capsys):
    rc, out, _ = run(["--version"], capsys)
    assert rc == 0 and out.strip() == f"mega-async {mega_async.__version__}"
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", mega_async.__version__)
    r = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.stdout.strip().splitlines()[-1] == mega_async.__version__  # setup.py reads it, it does not repeat it


def test_launch_help_lists_its_subcommands(capsys):
    rc, out, _ = run(["launch", "--help"], capsys)
    assert rc == 0 and "slurm" in out and "usage: mega-async launch" in out
    rc, out, _ = run(["launch", "slurm", "--help"], capsys)
    assert rc == 0 and "--gpus-per-node" in out and "mega-async train --help" in out
    rc, _, err = run(["launch"], capsys)
    assert rc == 2 and "slurm" in err
    rc, _, err = run(["launch", "pbs"], capsys)
    assert rc == 2 and "unknown scheduler 'pbs'" in err


@pytest.mark.parametrize("command, needle", [("convert", "hf-to-mcore"), ("bench", "--baseline"),
                                             ("serve", "--model"), ("init-weights", "model_dir")])
def test_every_command_has_help(command, needle, capsys):
    rc, out, _ = run([command, "--help"], capsys)
    assert rc == 0 and needle in out


def test_unknown_override_on_train_says_did_you_mean(tmp_path, capsys):
    rc, _, err = run(["train", "trainer.total_stepz=3", f"logging.root_dir={tmp_path}"], capsys)
    line = err.strip()
    assert rc == 2 and "\n" not in line
    assert line == ("mega-async train: ConfigError: override trainer.total_stepz: unknown key; did you mean "
                    "trainer.total_steps?")
    rc, _, err = run(["train", "trainer.max_staleness=3"], capsys)  # the right name in another section
    assert rc == 2 and "did you mean rollout.max_staleness?" in err
    rc, _, err = run(["train", "trainer.steps=3"], capsys)  # the SFT config's old name
    assert rc == 2 and "did you mean trainer.total_steps?" in err
    rc, _, err = run(["train", "zzz.qqq=1"], capsys)
    assert rc == 2 and "zzz: unknown key; `mega-async train --help` lists every key" in err
    rc, _, err = run(["sft", "trainer.stepz=3"], capsys)  # the same implementation
    assert rc == 2 and "override trainer.stepz: unknown key; did you mean trainer.total_steps" in err
    assert not any(tmp_path.iterdir())


def test_unknown_key_in_a_file_names_the_file(tmp_path):
    from mega_async.api.config import ConfigError
    from mega_async.api.config_load import load_config

    p = tmp_path / "c.yaml"
    p.write_text("rollout:\n  temprature: 0.5\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert str(ei.value) == (f"ConfigError: {p}: rollout.temprature: unknown key; did you mean "
                             "rollout.temperature?")


def test_yaml_syntax_error_names_file_line_and_column(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  max_staleness: 3\n   group_size: 4\n")
    rc, _, err = run(["train", "-c", str(bad)], capsys)
    assert rc == 2
    assert err == f"mega-async train: ConfigError: {bad}:3:14: invalid YAML: mapping values are not allowed here; " \
                  "fix the file there\n"
    bad.write_text("seed: 1\nrollout: {group_size: [4, 8}\n")
    rc, _, err = run(["sft", "-c", str(bad)], capsys)
    assert rc == 2 and err.startswith(f"mega-async sft: ConfigError: {bad}:2:") and err.count("\n") == 1
    assert "line 2, column 23" in err  # where the unclosed list started
