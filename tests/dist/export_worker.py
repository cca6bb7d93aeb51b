"""One HF export (save_hf_checkpoint) of a card, in its own process, that can hold after its first shard file is
written (--hold-after-first-shard: writes <signals>/<name>.wrote, waits for <signals>/<other>.done) and says when it
has finished (<signals>/<name>.done). tests/dist/test_export_output.py runs two at once to one output."""
import argparse
import time
from pathlib import Path

import safetensors.torch

from mega_async.trainer.model import build_model
from mega_async.trainer.parallel import destroy_parallel_state
from mega_async.trainer.weights import save_hf_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--signals", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--wait-for", help="start exporting only once <signals>/<this> exists")
    ap.add_argument("--hold-until", help="after the first shard file, wait until <signals>/<this> exists")
    args = ap.parse_args()
    signals = Path(args.signals)
    models = build_model(args.model, "megatron:d1", load_weights=True)

    def wait(name: str) -> None:
        deadline = time.monotonic() + 300
        while not (signals / name).exists():
            assert time.monotonic() < deadline, f"{args.name}: {name} never came"
            time.sleep(0.05)

    if args.hold_until:
        real = safetensors.torch.save_file

        def save_then_hold(*a, **kw):
            real(*a, **kw)
            (signals / f"{args.name}.wrote").touch()
            wait(args.hold_until)

        safetensors.torch.save_file = save_then_hold
    if args.wait_for:
        wait(args.wait_for)
    save_hf_checkpoint(models, args.out, src_dir=args.model)
    (signals / f"{args.name}.done").touch()
    destroy_parallel_state()


if __name__ == "__main__":
    main()
