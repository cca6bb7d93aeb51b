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


@pytest.mark.parametrize("override,said", [
    ("trainer.sync_master_address=999.1.1.1", "is not an IP address or a host name"),
    ("trainer.sync_master_address=bad_host!", "is not an IP address or a host name"),
    ("trainer.sync_timeout=1e-9", "trainer.sync_timeout=1e-09 is below 1 s"),
])
def test_a_trainer_side_sync_setting_that_cannot_work_is_refused(override, said):
    with pytest.raises(ConfigError, match=said):
        load_config("configs/tiny_cpu.yaml", [override])


def test_sync_master_addresses_that_can_work_pass():
    for host in ("127.0.0.1", "::1", "node-3.cluster.local", "localhost"):
        assert load_config("configs/tiny_cpu.yaml", [f"trainer.sync_master_address={host}"]).trainer.sync_master_address


def test_an_unresolvable_master_address_is_refused_before_anything_starts():
    from mega_async.run.tasks import check_inputs

    cfg = load_config("configs/tiny_cpu.yaml", ["trainer.sync_master_address=no-such-host.invalid"])
    with pytest.raises(ConfigError, match="does not resolve on this host"):
        check_inputs(cfg)


def test_a_prompt_longer_than_any_token_budget_is_dropped_without_tokenizing():
    """A row of many MB (data.max_row_bytes raised) is dropped by its length against data.max_prompt_tokens times
    the tokenizer's longest token, never handed to the tokenizer (which took gigabytes and aborted on 300 MB)."""
    from mega_async.run.tasks import longest_token, within_prompt_budget

    class Tok:
        def get_vocab(self):
            return {"a": 0, "abcd": 1, "<|x|>": 2}

        def __call__(self, text, add_special_tokens=False):
            assert len(text) < 10_000, "a huge prompt reached the tokenizer"
            return {"input_ids": [1] * ((len(text) + 3) // 4)}

    class Workflow:
        tokenizer = Tok()

        def encode(self, it):
            return self.tokenizer(it["prompt"])["input_ids"], it["prompt"]

    cfg = load_config("configs/tiny_cpu.yaml", ["data.max_prompt_tokens=16"])
    assert longest_token(Tok()) == 5
    items = [{"prompt": "x" * 40}, {"prompt": "y" * 50_000_000}, {"messages": [{"role": "user", "content": "z" * 10 ** 6}]}]
    assert within_prompt_budget(items, Workflow(), cfg) == items[:1]
