"""Compressed upstream CRDs for offline validation (testkit.crd_validation); `vendor.py` regenerates them."""
