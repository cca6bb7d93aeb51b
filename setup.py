"""mega_async: asynchronous RL post-training of Mixture-of-Experts LLMs (Megatron-Core + SGLang)."""
import re
from pathlib import Path

from setuptools import find_packages, setup

# the version's one source is mega_async/__init__.py (`mega-async --version` prints it); read, not imported
VERSION = re.search(r'^__version__ = "([^"]+)"', (Path(__file__).parent / "mega_async" / "__init__.py").read_text(),
                    re.M).group(1)

CORE = [
    # torch is pinned only on the CPU path (requirements-cpu.txt); GPU users bring their CUDA build.
    "torch>=2.13",
    "megatron-core==0.16.1",
    "mbridge==0.15.1",
    "transformers>=5.0",
    "safetensors>=0.6",
    "omegaconf>=2.3",
    "pyyaml>=6.0",
    "aiohttp>=3.9",
    "math-verify>=0.8",
    "tensorboard>=2.16",
    "rich>=13.0",
    "tqdm>=4.66",
    "matplotlib>=3.8",
    "nvidia-ml-py>=12.0",
    "numpy>=1.26",
    "einops>=0.7",  # mbridge imports it for its VLM bridges
    "psutil>=5.9",  # Megatron distributed checkpoints
]

setup(
    name="mega_async",
    version=VERSION,
    description="Asynchronous RL post-training of large MoE language models with Megatron-Core and SGLang",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["mega_async", "mega_async.*"]),
    package_data={"mega_async.launch.slurm": ["templates/*"]},  # the sbatch templates: pip installs ship them
    install_requires=CORE,
    extras_require={
        # GPU-only packages: imported lazily, never needed on the CPU path.
        # sglang: the releases whose weight-sync protocol is tested (mega_async/api/sglang_releases.py)
        "gpu": ["transformer-engine[pytorch]", "flash-attn", "apex", "sglang>=0.5.18,<=0.5.23", "smg==1.13.0"],
        # pyarrow: the GSM8K parquet path; py-spy: stacks of a hung test run; pydantic: the reference the
        # embedded server's lax coercions are held to (its integer-size rule changed in 2.14)
        # pytest-xdist: the default suite on two processes (one test file each at a time: its fixtures built once)
        "test": ["pytest>=8.0", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "hypothesis>=6.100", "openai>=1.40",
                 "pyarrow>=14", "py-spy>=0.3.14", "pydantic>=2.14,<3",
                 "scipy>=1.11"],  # scipy: the reference the paper benchmark's t quantiles are held to
        "agent": ["openai>=1.40"],  # agents of AgentWorkflow (mega_async.rollout.agent) use the openai client
    },
    entry_points={"console_scripts": ["mega-async=mega_async.cli:main"]},
)
