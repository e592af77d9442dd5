"""Prefix hashing and the approximate prefix-cache index."""
