"""Filters, one module each."""
