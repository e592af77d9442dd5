"""Shared helpers for tests that start real processes (Envoy, the picker, the simulator)."""
