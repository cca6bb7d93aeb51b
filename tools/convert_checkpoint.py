"""HF <-> Megatron checkpoint conversion (same as `mega-async convert`).

    python tools/convert_checkpoint.py hf-to-mcore --hf models/tiny-qwen3-moe --out ckpt/mcore --allocation megatron:d1
    torchrun --nproc-per-node 2 tools/convert_checkpoint.py hf-to-mcore --hf DIR --out OUT --allocation megatron:t2
    python tools/convert_checkpoint.py mcore-to-hf --mcore ckpt/mcore --out ckpt/hf
"""
import sys

from mega_async.checkpoint.convert import main

if __name__ == "__main__":
    sys.exit(main())
