"""The GPU serving scenario (configs/bench/serve_gpu.yaml, mega_async.bench.serving) without a GPU: the server it
starts is the recipe's own command line at the TP/EP the GPUs allow, its model loads in transformers, and a CPU
machine leaves it out of the nightly run (its measurement runs in tests/unit/test_bench_gpu.py's dry run, on real
SGLang's CPU engine)."""
import pytest
import torch

from mega_async.bench import scenarios as bench
from mega_async.bench import serving
from mega_async.bridge.model_cards import TINY_MOE
from mega_async.inference.servers import server_command

SCENARIO = bench.SCENARIO_DIR / "serve_gpu.yaml"


def test_server_width_is_the_most_gpus_that_divide_the_experts_within_the_recipes_width():
    assert [serving.server_width(g, 16, 8) for g in (0, 1, 2, 3, 4, 6, 8, 16)] == [1, 1, 2, 2, 4, 4, 8, 8]
    assert serving.server_width(8, 6, 8) == 6 and serving.server_width(4, 7, 8) == 1


@pytest.mark.parametrize("gpus, width", [(1, 1), (2, 2), (8, 8), (16, 8)])
def test_the_benchmarked_server_is_the_one_the_recipe_starts(gpus, width):
    """Real SGLang with the recipe's flags (dtype, radix cache off, its extra_args) at TP = EP = width on GPU 0 on;
    the embedded baseline with its own flags only (SGLang's would fail it)."""
    serve = bench.load_scenario(SCENARIO).serve
    line = server_command(serving.bench_server_spec(serve["config"], TINY_MOE, "sglang", gpus, 64), 0)
    assert line[1:3] == ["-m", "sglang.launch_server"]
    assert line[line.index("--tp-size") + 1] == str(width) and line[line.index("--base-gpu-id") + 1] == "0"
    assert (line[line.index("--ep-size") + 1] == str(width)) if width > 1 else "--ep-size" not in line
    assert line[line.index("--dtype") + 1] == "bfloat16" and "--disable-radix-cache" in line
    assert line[line.index("--mem-fraction-static") + 1] == "0.8" and "--device" not in line
    base = server_command(serving.bench_server_spec(serve["config"], TINY_MOE, "embedded", gpus, 64), 0)
    assert base[1:3] == ["-m", "mega_async.server"] and "--mem-fraction-static" not in base
    assert base[base.index("--device") + 1] == "cuda" and base[base.index("--max-running-requests") + 1] == "64"


def test_without_a_gpu_the_real_engine_runs_on_its_cpu_engine():
    line = server_command(serving.bench_server_spec("configs/tiny_cpu_sglang.yaml", TINY_MOE, "sglang", 0, 4), 0)
    assert line[line.index("--device") + 1] == "cpu" and "--base-gpu-id" not in line


def test_the_random_model_loads_in_transformers(tmp_path, monkeypatch):
    """bench_model writes the names and shapes transformers expects (a small size here; moe_1b is the same code)."""
    from transformers import AutoModelForCausalLM

    small = dict(serving.MOE_1B, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=4, vocab_size=1024)
    monkeypatch.setitem(serving.SIZES, "small", small)
    d = serving.bench_model("small", tmp_path / "m", dtype="bfloat16")
    model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and model.dtype == torch.bfloat16
    assert (d / "tokenizer.json").exists()
    assert float(model.model.embed_tokens.weight.float().std()) == pytest.approx(0.02, rel=0.2)
    assert float(model.model.norm.weight.float().min()) == 1.0
    with pytest.raises(ValueError, match="serve.model='huge'"):
        serving.bench_model("huge", tmp_path / "h")


def test_a_cpu_machine_leaves_the_gpu_scenario_out_and_refuses_it_by_name(tmp_path):
    s = bench.load_scenario(SCENARIO)
    assert s.device == "gpu" and s.serve["model"] == "moe_1b"
    assert set(s.figures) == {"sglang_gen_tokens_per_s", "embedded_gen_tokens_per_s", "sglang_over_embedded"}
    names = {x.name for x in bench.find_scenarios()}
    if torch.cuda.is_available():  # a GPU machine's nightly run has it
        assert "serve_gpu" in names and bench.find_scenarios(["serve_gpu"])[0].name == "serve_gpu"
    else:
        assert "serve_gpu" not in names
        with pytest.raises(bench.BenchError, match="needs a GPU and none is visible here.*--cpu-dry-run"):
            bench.find_scenarios(["serve_gpu"])
    bad = tmp_path / "bad.yaml"
    for text, msg in (("name: x\nserve: {model: tiny}\n", "serve: takes config"),
                      ("name: x\nserve: {config: c.yaml, model: huge}\n", "serve: takes config"),
                      ("name: x\nserve: {config: c.yaml, gpus: 2}\n", "serve: takes config"),
                      ("name: x\ndevice: tpu\nexecutor: {}\n", "device='tpu'")):
        bad.write_text(text)
        with pytest.raises(bench.BenchError, match=msg):
            bench.load_scenario(bad)
