"""mega_async: asynchronous RL post-training of Mixture-of-Experts LLMs (Megatron-Core + SGLang)."""

__version__ = "0.1.0"  # the one source of the version: setup.py reads it from here
