"""Settings the run relies on cannot be overridden from inference.extra_args / router_args, and seeds fit every
consumer: refused at start in one line naming the key (before: a server on port 1 or on every interface, or an int64
overflow in the server 79 s later)."""
import subprocess
import sys

import pytest

from mega_async.api.config import MAX_SEED, ConfigError
from mega_async.api.config_load import load_config
from mega_async.api.sft_config import load_sft_config
from tests.commands import ROOT


@pytest.mark.parametrize("key,args,flag", [
    ("inference.extra_args", "[--port,1]", "--port"),
    ("inference.extra_args", "[--host=0.0.0.0]", "--host"),
    ("inference.extra_args", "[--api-key,x]", "--api-key"),
    ("inference.extra_args", "[--model-path,/elsewhere]", "--model-path"),
    ("inference.extra_args", "[--po,1]", "--po"),  # argparse would take the abbreviation
    ("inference.router_args", "[--worker-urls,http://elsewhere]", "--worker-urls"),
    ("inference.router_args", "[--port,1]", "--port"),
])
def test_flags_the_run_sets_are_refused(key, args, flag):
    extra = ["inference.router=smg"] if key.endswith("router_args") else []
    with pytest.raises(ConfigError, match=f"{key} sets {flag}, which the run sets itself"):
        load_config("configs/tiny_cpu.yaml", [f"{key}={args}", *extra])


def test_other_flags_pass():
    cfg = load_config("configs/tiny_cpu.yaml", ["inference.extra_args=[--mem-fraction-static,0.8,--model-loader-extra-config,{}]"])
    assert "--mem-fraction-static" in cfg.inference.extra_args


@pytest.mark.parametrize("seed", [-1, MAX_SEED + 1, 99999999999999999999999])
def test_seeds_out_of_range_are_refused(seed):
    with pytest.raises(ConfigError, match=f"seed={seed} must be in"):
        load_config("configs/tiny_cpu.yaml", [f"seed={seed}"])
    with pytest.raises(ConfigError, match=f"seed={seed} must be in"):
        load_sft_config("configs/addition_sft_cpu.yaml", [f"seed={seed}"])
    assert load_config("configs/tiny_cpu.yaml", [f"seed={MAX_SEED}"]).seed == MAX_SEED


def test_the_server_refuses_an_absurd_card_and_seed_in_one_line(tmp_path):
    import json
    import shutil

    card = tmp_path / "absurd"
    shutil.copytree(ROOT / "models" / "tiny-qwen3-moe", card, ignore=shutil.ignore_patterns("*.safetensors*"))
    cfg = json.loads((card / "config.json").read_text())
    (card / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 10 ** 6, "hidden_size": 10 ** 5}))
    for args, said in ((["--model", str(card)], "the model card asks for"),
                       (["--model", str(ROOT / "models" / "tiny-qwen3-moe"), "--random-seed", str(2 ** 63)],
                        "--random-seed")):
        r = subprocess.run([sys.executable, "-m", "mega_async.cli", "serve", *args, "--port", "1"], capture_output=True,
                           text=True, timeout=120, cwd=ROOT)
        assert r.returncode != 0 and said in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
