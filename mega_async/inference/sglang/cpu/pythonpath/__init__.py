"""Put on a CPU SGLang server's PYTHONPATH by the launcher (not imported as a package): `sgl_kernel/` (the
stand-in) and `sitecustomize.py` (applies mega_async.inference.sglang.cpu.patches in every server process)."""
