"""Inference layer: SGLang-protocol client, embedded CPU server, server launcher, simulator."""
