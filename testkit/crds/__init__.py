"""Vendored upstream CRDs (data): `apiserver/` for a real kube-apiserver, `schemas/` for offline validation."""
