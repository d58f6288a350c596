"""Probes and models: optional, may import commlib and benchmarks; nothing imports them."""
