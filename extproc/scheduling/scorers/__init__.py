"""Scorers, one module each."""
