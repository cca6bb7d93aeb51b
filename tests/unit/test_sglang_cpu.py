"""The real SGLang engine's CPU pieces that need no engine: the sgl_kernel stand-in against a hand-computed
reference, the host-pool fix applied through the servers' sitecustomize, the launcher's command line, environment
and interpreter checks (tests/integration/test_sglang_cpu.py runs the real engine)."""
import importlib.util
import json
import os
import stat
import subprocess
import sys
from collections import defaultdict

import pytest
import torch

from mega_async.inference import servers
from mega_async.inference.sglang import cpu as sglang_cpu
from mega_async.inference.sglang.cpu import patches


def _stand_in():
    path = sglang_cpu.PYTHONPATH_DIR / "sgl_kernel" / "__init__.py"
    spec = importlib.util.spec_from_file_location("sgl_kernel_stand_in", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("offset_dtype", [torch.int32, torch.int64])
def test_assign_req_to_token_pool_cpu_writes_each_requests_new_slots_into_its_row(offset_dtype):
    kernel = _stand_in()
    req_to_token = torch.full((5, 32), -1, dtype=torch.int32)
    req_pool_indices = torch.tensor([2, 4, 1], dtype=torch.int64)
    start = torch.tensor([0, 3, 8], dtype=offset_dtype)
    end = torch.tensor([6, 3, 15], dtype=offset_dtype)  # the middle request gets no new slot
    out_cache_loc = torch.arange(100, 113, dtype=torch.int64)  # 6 + 0 + 7 slots
    kernel.assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start, end, out_cache_loc, 32)
    want = torch.full((5, 32), -1, dtype=torch.int32)
    want[2, 0:6] = torch.tensor([100, 101, 102, 103, 104, 105], dtype=torch.int32)
    want[1, 8:15] = torch.tensor([106, 107, 108, 109, 110, 111, 112], dtype=torch.int32)
    assert torch.equal(req_to_token, want)
    with pytest.raises(ValueError, match="13 new slots"):
        kernel.assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start, end, out_cache_loc[:5], 32)


def test_any_other_kernel_imports_and_raises_naming_itself_when_called():
    kernel = _stand_in()
    missing = kernel.copy_all_layer_kv_cache_cpu  # SGLang imports it at module level on CPU, never calls it
    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.copy_all_layer_kv_cache_cpu: .*stand-in"):
        missing(torch.zeros(1))
    with pytest.raises(AttributeError):
        kernel.__wrapped__  # noqa: B018 - dunder probes stay plain misses


def test_plain_host_alloc_allocates_without_registering():
    class Allocator:
        def allocate(self, dims, dtype, device):
            return torch.ones(dims, dtype=dtype, device=device)

    got = patches.plain_host_alloc((2, 3), torch.int32, "cpu", True, Allocator())
    assert got.shape == (2, 3) and got.dtype == torch.int32 and bool((got == 1).all())
    assert patches.plain_host_alloc((4,), torch.float32, "cpu", True, None).shape == (4,)


def _fake_host_pool(root):
    pkg = root / "sglang" / "srt" / "mem_cache" / "pool_host"
    pkg.mkdir(parents=True)
    for d in [root / "sglang", root / "sglang" / "srt", root / "sglang" / "srt" / "mem_cache", pkg]:
        (d / "__init__.py").write_text("")
    (pkg / "common.py").write_text("from collections import defaultdict\n"
                                   "def alloc_with_host_register(*a, **k): pass\n"
                                   "ALLOC_MEMORY_FUNCS = defaultdict(lambda: alloc_with_host_register)\n")


def _alloc_names(tmp_path, env):
    code = ("import json, sglang.srt.mem_cache.pool_host.common as c\n"
            "print(json.dumps({d: c.ALLOC_MEMORY_FUNCS[d].__name__ for d in ('cpu', 'cuda')}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_cpu_servers_processes_get_the_host_pool_fix_from_the_launchers_environment(tmp_path):
    """What SGLang's scheduler process sees: sitecustomize (first on the PYTHONPATH the launcher sets) fixes
    ALLOC_MEMORY_FUNCS['cpu'] as the module is imported; other devices keep SGLang's entry; without the CPU engine
    nothing changes."""
    _fake_host_pool(tmp_path)
    env = sglang_cpu.cpu_env({**os.environ, "PYTHONPATH": str(tmp_path)}, num_threads=1)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(sglang_cpu.PYTHONPATH_DIR), str(tmp_path)]
    assert _alloc_names(tmp_path, env) == {"cpu": "plain_host_alloc", "cuda": "alloc_with_host_register"}
    env["SGLANG_USE_CPU_ENGINE"] = "0"
    assert _alloc_names(tmp_path, env) == {"cpu": "alloc_with_host_register", "cuda": "alloc_with_host_register"}


def test_install_fixes_a_module_already_imported(monkeypatch):
    module = type(sys)("fake_common")
    module.ALLOC_MEMORY_FUNCS = defaultdict(lambda: "register")
    monkeypatch.setitem(sys.modules, patches.HOST_POOL_MODULE, module)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    patches.install()
    patches.install()  # once
    assert module.ALLOC_MEMORY_FUNCS["cpu"] is patches.plain_host_alloc
    assert sum(isinstance(f, patches.FixOnImport) for f in sys.meta_path) == 1


def test_a_cpu_server_command_has_the_cpu_flags_unless_extra_args_set_them():
    spec = servers.ServerSpec("sglang", "/m", device="cpu", python="/engine/bin/python", dtype="float32",
                              extra_args=["--max-total-tokens", "4096"])
    cmd = servers.server_command(spec, 47300)
    assert cmd[:3] == ["/engine/bin/python", "-m", "sglang.launch_server"]
    for flag in ["--disable-overlap-schedule", "--sleep-on-idle"]:
        assert cmd.count(flag) == 1
    assert cmd[cmd.index("--device") + 1] == "cpu"
    assert cmd[cmd.index("--attention-backend") + 1] == "torch_native"
    assert cmd.count("--max-total-tokens") == 1 and cmd[cmd.index("--max-total-tokens") + 1] == "4096"
    assert cmd.count("--dtype") == 1 and "--base-gpu-id" not in cmd
    bare = servers.server_command(servers.ServerSpec("sglang", "/m", device="cpu"), 47300)
    assert bare[bare.index("--dtype") + 1] == "float32"
    assert bare[bare.index("--max-total-tokens") + 1] == str(sglang_cpu.DEFAULT_MAX_TOTAL_TOKENS)
    gpu = servers.server_command(servers.ServerSpec("sglang", "/m", base_gpu_id=0), 47300)
    assert "--device" not in gpu and "--sleep-on-idle" not in gpu


def test_the_radix_cache_setting_reaches_both_backends():
    """inference.radix_cache: None keeps each backend's default (embedded on, real SGLang off as AReaL launches it);
    true turns it on for real SGLang too (which has no flag to enable it: the off flag is left out), false off for
    both, and a flag already in extra_args is not given twice."""
    def flags(backend, radix, extra=()):
        cmd = servers.server_command(servers.ServerSpec(backend, "/m", radix_cache=radix, extra_args=list(extra)), 1)
        return cmd.count("--disable-radix-cache")

    assert [flags("embedded", r) for r in (None, True, False)] == [0, 0, 1]
    assert [flags("sglang", r) for r in (None, True, False)] == [1, 0, 1]
    assert flags("sglang", None, ["--disable-radix-cache"]) == flags("embedded", False, ["--disable-radix-cache"]) == 1
    from mega_async.api.config_load import load_config

    assert load_config(None, ["inference.radix_cache=true"]).inference.radix_cache is True
    assert load_config(None, []).inference.radix_cache is None


def test_a_cpu_servers_environment():
    spec = servers.ServerSpec("sglang", "/m", device="cpu", num_servers=2, num_threads=3, api_key="k")
    env = servers.server_env(spec)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["OMP_NUM_THREADS"] == "3"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(sglang_cpu.PYTHONPATH_DIR)
    assert env[servers.API_KEY_ENV] == "k"
    assert "SGLANG_USE_CPU_ENGINE" not in servers.server_env(servers.ServerSpec("sglang", "/m"))


def test_engine_python_follows_sglang_cpu_venv(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="install_sglang_cpu.sh"):
        sglang_cpu.engine_python({sglang_cpu.VENV_ENV: str(tmp_path / "none")})
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    assert sglang_cpu.engine_python({sglang_cpu.VENV_ENV: str(tmp_path)}) == str(tmp_path / "bin" / "python")
    monkeypatch.setattr(sglang_cpu, "DEFAULT_VENV", str(tmp_path / "absent"))
    monkeypatch.setattr(sglang_cpu, "_here_has_sglang", lambda: False)
    with pytest.raises(FileNotFoundError, match="SGLang is not installed here and there is no engine environment"):
        sglang_cpu.engine_python({})


def _fake_engine(tmp_path, found):
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\necho '{json.dumps(found)}'\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return str(python)


def test_the_launcher_checks_the_engines_interpreter_before_anything_starts(tmp_path):
    ours = str(sglang_cpu.PYTHONPATH_DIR.parents[2])
    no_project = _fake_engine(tmp_path, {"sglang": "0.5.23", "mega_async": None})
    with pytest.raises(RuntimeError, match="cannot import mega_async.*install_sglang_cpu.sh"):
        servers.ServerLauncher(servers.ServerSpec("sglang", "/m", device="cpu", python=no_project))
    (tmp_path / "new").mkdir()
    too_new = _fake_engine(tmp_path / "new", {"sglang": "0.5.30", "mega_async": ours})
    with pytest.raises(RuntimeError, match="SGLang 0.5.30 is outside the tested range"):
        servers.ServerLauncher(servers.ServerSpec("sglang", "/m", device="cpu", python=too_new))
    (tmp_path / "ok").mkdir()
    good = _fake_engine(tmp_path / "ok", {"sglang": "0.5.23", "mega_async": ours})
    launcher = servers.ServerLauncher(servers.ServerSpec("sglang", "/m", device="cpu", python=good),
                                      log_dir=str(tmp_path / "logs"))
    assert launcher.spec.python == good
