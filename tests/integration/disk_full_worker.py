"""One trainer rank writes checkpoints into a run directory on a small filesystem (tests/integration/test_disk_full.py
mounts it): step 0 fits, step 1 does not. Writes JSON: each failure's type and message, what is left on disk, and
whether step 0 still loads.

    refused   step 1 is refused before writing: the free space is less than its state dict needs
    midwrite  the check is skipped (as when another writer fills the disk meanwhile): the write itself runs out
"""
import argparse
import json
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import mega_async.checkpoint.format as ckpt
    from mega_async.checkpoint.check import verify_manifest
    from mega_async.trainer.engine import EngineConfig, MegatronTrainEngine
    from mega_async.trainer.parallel import destroy_parallel_state
    from mega_async.api.types import WeightVersion
    from tests.dist.engine_worker import synthetic_batch

    result: dict = {}
    eng = MegatronTrainEngine(args.model, "megatron:d1", EngineConfig.of(lr=0.05, total_steps=10),
                              version=WeightVersion(1))
    eng.train_batch(synthetic_batch(seed=0))
    result["first"] = str(ckpt.save_checkpoint(args.run_dir, 0, eng, version=1, allocation="megatron:d1",
                                               rollout_state={"x": 1}))
    before = {k: v.clone() for k, v in eng.models[0].state_dict().items() if hasattr(v, "clone")}
    for case in ("refused", "midwrite"):
        if case == "midwrite":  # the check passes: the disk fills up under the write
            ckpt._space_check = lambda final, sd, rollout: (ckpt.state_bytes(sd), ckpt.free_bytes(final.parent))
        try:
            ckpt.save_checkpoint(args.run_dir, 1, eng, version=2, allocation="megatron:d1", rollout_state={"x": 2})
            result[case] = {"error": None}
        except Exception as e:  # noqa: BLE001 - reported
            result[case] = {"error": type(e).__name__, "message": str(e), "errno": getattr(e, "errno", None)}
        root = Path(args.run_dir) / "checkpoints"
        result[case]["left"] = sorted(p.name for p in root.iterdir())
    latest = ckpt.latest_checkpoint(args.run_dir)
    result["latest"] = latest.name
    result["manifest_ok"] = verify_manifest(latest)
    meta = ckpt.load_checkpoint(latest, eng)  # resume works from the older checkpoint
    result["loaded"] = {"step": meta["step"], "version": meta["version"], "rollout": meta["rollout"]}
    result["weights_equal"] = all(bool((eng.models[0].state_dict()[k] == v).all()) for k, v in before.items())
    Path(args.out).write_text(json.dumps(result))
    destroy_parallel_state()


if __name__ == "__main__":
    main()
