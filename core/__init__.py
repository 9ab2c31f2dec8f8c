"""Hivekeeper's core: detection and measurement, the model runtime, the offloading engine, the swarm, the CLI."""
