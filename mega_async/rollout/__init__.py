"""Rollout layer: staleness-gated asynchronous episode execution."""
