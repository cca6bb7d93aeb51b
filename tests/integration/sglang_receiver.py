"""An SGLang server's weight-receive side, assembled from one SGLang release's own code, on CPU with gloo.

Run with PYTHONPATH=<cache>/sglang-<version> (sglang_releases.ensure_sglang: the wheel and its import-time
pure dependencies, no CUDA packages; the few CUDA-only imports are stubbed, sglang_stubs.py):

    python tests/integration/sglang_receiver.py --model DIR --port P

What is SGLang's (imported from the release, not re-implemented):
  * the HTTP layer: the release's FastAPI app (sglang.srt.entrypoints.http_server.app) under uvicorn, so
    routes, request parsing, status codes and bodies are that release's; its lifespan is off (it would start
    the tokenizer and the scheduler processes);
  * the tokenizer manager's control path: TokenizerManager's methods and TokenizerControlMixin
    (init_communicators, update_weights_from_distributed, begin/end_weight_update, pause/continue_generation,
    the pause condition and the model-update lock, weight_version bookkeeping) on an instance whose __init__
    (ZMQ sockets, tokenizer, detokenizer) is replaced by the attributes those methods read;
  * the scheduler side: SchedulerWeightUpdaterManager (scheduler_components/weight_updater.py: session checks,
    flush after update, weight-version change via Scheduler.record_weight_version_change), the TP worker's
    methods (TpModelWorker) and the model runner's WeightUpdater (receive by broadcast, FlattenedTensorBucket,
    init_custom_process_group, destroy), plus ModelRunner.check_weights with SGLang's WeightChecker;
  * the config: a real ServerArgs for the model card, published with runtime_context.publish.

What is ours: the transport between the two managers (a thread with a queue instead of ZMQ; the scheduler
thread handles one request at a time, as SGLang's scheduler loop does), a flush_cache that records its calls
(no KV cache here), and the model: `NamedModel` holds the card's HF-named tensors and its load_weights copies
by name with SGLang's default_weight_loader (SGLang's Qwen3-MoE module needs CUDA kernels). Two routes are
ours too, under /interop/: dump the model's tensors to a safetensors file, and the scheduler's request log.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import logging
import os
import queue
import sys
import threading
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sglang_stubs  # noqa: E402

VERSION = importlib.metadata.version("sglang")
STUBBED = sglang_stubs.install(sglang_stubs.for_version(VERSION))
# /health would otherwise run a one-token generation through the (absent) scheduler
os.environ.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

if not torch.cuda.is_available():  # 0.5.20's WeightChecker brackets the checksum with torch.cuda.synchronize()
    torch.cuda.synchronize = lambda device=None: None

logger = logging.getLogger("sglang_receiver")


def _version_tuple(v: str) -> tuple:
    return tuple(int(x) for x in v.split(".")[:3] if x.isdigit())


class NamedModel(torch.nn.Module):
    """Ours: the card's HF-named tensors as parameters (named_parameters() gives the HF names) and SGLang's
    load_weights contract: (name, tensor) pairs, copied by name with SGLang's default_weight_loader."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        for name, t in tensors.items():
            *path, leaf = name.split(".")
            mod: torch.nn.Module = self
            for p in path:
                if not hasattr(mod, p):
                    mod.add_module(p, torch.nn.Module())
                mod = getattr(mod, p)
            mod.register_parameter(leaf, torch.nn.Parameter(t.clone(), requires_grad=False))
        self.loads: list[int] = []  # tensors per load_weights call

    def load_weights(self, weights):
        from sglang.srt.model_loader.weight_utils import default_weight_loader

        params = dict(self.named_parameters())
        n = 0
        for name, w in weights:
            if name not in params:
                raise KeyError(f"{name} is not a parameter of this model")
            default_weight_loader(params[name], w)
            n += 1
        self.loads.append(n)


class Scheduler:
    """The scheduler process, reduced to its request loop over SGLang's handlers (one thread, one request at a
    time) and the state those handlers read. Results go back to the tokenizer manager's result dispatcher."""

    def __init__(self, model: NamedModel, model_config, tp_cpu_group):
        from sglang.srt.managers import io_struct as io
        from sglang.srt.managers.scheduler import Scheduler as SGLangScheduler
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
        from sglang.srt.managers.tp_worker import TpModelWorker
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
        from sglang.srt.runtime_context import get_model
        from sglang.srt.utils.weight_checker import WeightChecker
        from sglang.utils import TypeBasedDispatcher

        self.model = model
        self.log: list[dict] = []
        self.flushes: list[dict] = []
        self._queue: queue.Queue = queue.Queue()
        self._reply = None

        class Runner:  # SGLang's ModelRunner, reduced to what the weight path reads
            check_weights = ModelRunner.check_weights

        runner = Runner()
        runner.model = model
        runner.weight_updater = WeightUpdater(
            tp_rank=0, device="cpu", gpu_id=0, model_config=model_config,
            custom_weight_loaders=get_model().custom_weight_loader, get_model=lambda: runner.model,
            update_model_fields=lambda *a, **k: None, recapture_cuda_graph=lambda: None,
            get_model_runner=lambda: runner)
        ps = types.SimpleNamespace(tp_rank=0, tp_size=1, dp_rank=None, attn_dp_size=1, pp_rank=0, pp_size=1)
        try:
            runner._weight_checker = WeightChecker(get_model=lambda: runner.model)
        except TypeError:  # 0.5.20 passes the runner's parallel state
            runner._weight_checker = WeightChecker(get_model=lambda: runner.model, ps=ps)
        self.runner = runner

        class TpWorker:  # SGLang's TpModelWorker methods over one model runner
            pass

        for name in ("init_weights_update_group", "destroy_weights_update_group", "update_weights_from_distributed",
                     "weight_update_runners", "get_weights_by_name"):
            if hasattr(TpModelWorker, name):
                setattr(TpWorker, name, getattr(TpModelWorker, name))
        worker = TpWorker()
        worker._model_runner = worker.model_runner = runner
        worker.ps = ps

        # what Scheduler.record_weight_version_change reads: no request is live in this receiver
        self.waiting_queue: list = []
        self.chunked_req = None
        self.hisparse_coordinator = None
        self.collect_inflight_reqs = lambda: set()
        self.record_weight_version_change = types.MethodType(SGLangScheduler.record_weight_version_change, self)

        kw = dict(tp_worker=worker, draft_worker=None, memory_saver_adapter=None, flush_cache=self.flush_cache,
                  is_fully_idle=lambda *a, **k: True, scheduler=self, metrics_collector=None)
        fields = getattr(SchedulerWeightUpdaterManager, "__dataclass_fields__", {})
        if "tp_cpu_group" in fields and fields["tp_cpu_group"].init:  # 0.5.20 passes it; 0.5.23 reads get_parallel()
            kw["tp_cpu_group"] = tp_cpu_group
        self.weight_updater = SchedulerWeightUpdaterManager(**kw)

        wu = self.weight_updater
        pairs = [(io.InitWeightsUpdateGroupReqInput, wu.init_weights_update_group),
                 (io.DestroyWeightsUpdateGroupReqInput, wu.destroy_weights_update_group),
                 (io.UpdateWeightsFromDistributedReqInput, wu.update_weights_from_distributed),
                 (io.GetWeightsByNameReqInput, wu.get_weights_by_name),
                 (io.CheckWeightsReqInput, wu.check_weights),
                 (io.AbortReq, lambda req: None),  # nothing runs here: nothing to abort
                 (io.PauseGenerationReqInput, lambda req: None),
                 (io.ContinueGenerationReqInput, lambda req: None),
                 (io.GetInternalStateReq, lambda req: io.GetInternalStateReqOutput(
                     internal_state={"interop_receiver": True, "sglang_version": VERSION}))]
        if hasattr(io, "BeginWeightUpdateReqInput"):  # 0.5.21+
            pairs += [(io.BeginWeightUpdateReqInput, wu.begin_weight_update),
                      (io.EndWeightUpdateReqInput, wu.end_weight_update)]
        self.dispatcher = TypeBasedDispatcher(pairs)
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self._thread.start()

    def flush_cache(self, empty_cache: bool = False, **kw) -> bool:
        """Ours: no KV cache and no request here, so a flush always succeeds (as SGLang's with nothing running)."""
        self.flushes.append({"empty_cache": empty_cache, **kw})
        return True

    def submit(self, obj) -> None:
        self._queue.put(obj)

    def _loop(self) -> None:
        while True:
            obj = self._queue.get()
            entry = {"type": type(obj).__name__, "t": time.time()}
            try:
                out = self.dispatcher(obj)
            except Exception:  # as SGLang's run_scheduler_process: "Scheduler hit an exception", the server dies
                logger.exception("Scheduler hit an exception handling %s: the SGLang server exits",
                                 type(obj).__name__)
                os._exit(70)
            if out is not None:
                entry["success"] = getattr(out, "success", None)
                entry["message"] = getattr(out, "message", None)
            for k in ("names", "load_format", "weight_version", "flush_cache", "group_name", "selector"):
                if hasattr(obj, k):
                    v = getattr(obj, k)
                    entry[k] = len(v) if k == "names" else v
            self.log.append(entry)
            if out is not None:
                self._reply(out)


def make_front(server_args, model_config, scheduler: Scheduler, loop: asyncio.AbstractEventLoop):
    """SGLang's TokenizerManager without its __init__ (which opens ZMQ sockets and loads the tokenizer):
    the attributes its control methods read, then SGLang's own init_communicators."""
    from sglang.srt.managers.tokenizer_manager import ServerStatus, TokenizerManager
    from sglang.srt.utils.aio_rwlock import RWLock
    from sglang.utils import TypeBasedDispatcher

    class Front(TokenizerManager):
        def __init__(self):  # noqa: D401 - replaces TokenizerManager.__init__
            self.server_args = server_args
            self.model_config = model_config
            self.model_path = server_args.model_path
            self.served_model_name = server_args.served_model_name or server_args.model_path
            self.is_generation = True
            self.startup_time = {}
            self.gracefully_exit = False
            self.server_status = ServerStatus.Up
            self.last_receive_tstamp = time.time()
            self.tokenizer_ipc_name = None
            self.mm_processor = None
            self.enable_metrics = False
            self.rid_to_state = {}
            self.event_loop = loop  # auto_create_handle_loop: the results come from the scheduler thread instead
            self.asyncio_tasks = set()
            self.is_pause = False
            self.is_pause_cond = asyncio.Condition()
            self.model_update_lock = RWLock()
            self._result_dispatcher = TypeBasedDispatcher([])
            self.init_communicators()

        def _dispatch_to_scheduler(self, obj) -> None:
            scheduler.submit(obj)

        async def _async_dispatch_to_scheduler(self, obj) -> None:
            scheduler.submit(obj)

    front = Front()
    scheduler._reply = lambda out: loop.call_soon_threadsafe(front._result_dispatcher, out)
    return front


def add_interop_routes(app, scheduler: Scheduler) -> None:
    """Ours, under /interop/: read back what the model received, and what the scheduler handled."""
    from fastapi import Body
    from fastapi.responses import JSONResponse
    from safetensors.torch import save_file

    @app.post("/interop/dump_weights")
    async def dump_weights(body: dict = Body(...)):
        tensors = {n: p.detach().contiguous().clone() for n, p in scheduler.model.named_parameters()}
        save_file(tensors, body["path"])
        return JSONResponse({"success": True, "num_tensors": len(tensors), "loads": list(scheduler.model.loads)})

    @app.get("/interop/log")
    async def log():
        return JSONResponse({"version": VERSION, "stubbed": STUBBED, "requests": scheduler.log,
                             "flushes": scheduler.flushes})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="HF card directory with config.json and model.safetensors")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    t0 = time.monotonic()

    # SGLang's receive path needs a default process group (init_weights_update_group asserts one) and a CPU group
    # of the server's TP ranks (the barriers of begin/end_weight_update and update_weights_from_tensor)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    tp_cpu_group = dist.new_group([0], backend="gloo")

    from safetensors.torch import load_file
    from sglang.srt import runtime_context as rc
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path=args.model, device="cpu", host=args.host, port=args.port,
                             skip_tokenizer_init=True)
    if "ranks" in rc.publish.__code__.co_varnames:  # 0.5.23
        rc.publish(server_args, role="scheduler", ranks=rc.SpawnRanks(world_rank=0))
        rc.get_parallel().override_permanently(tp_group=types.SimpleNamespace(cpu_group=tp_cpu_group))
    else:
        rc.publish(server_args, role="scheduler")
    model_config = ModelConfig.from_server_args(server_args)
    model = NamedModel(load_file(str(Path(args.model) / "model.safetensors")))

    from sglang.srt.entrypoints import http_server

    scheduler = Scheduler(model, model_config, tp_cpu_group)
    add_interop_routes(http_server.app, scheduler)

    import uvicorn

    async def serve() -> None:
        front = make_front(server_args, model_config, scheduler, asyncio.get_running_loop())
        http_server.set_global_state(http_server._GlobalState(tokenizer_manager=front, template_manager=None,
                                                              scheduler_info={}))
        config = uvicorn.Config(http_server.app, host=args.host, port=args.port, lifespan="off",
                                log_level="warning", access_log=False)
        print(f"sglang {VERSION} receiver on {args.host}:{args.port} (stubbed: {', '.join(STUBBED)}; "
              f"ready in {time.monotonic() - t0:.1f} s)", flush=True)
        await uvicorn.Server(config).serve()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
