"""Generated protobuf modules (see protos/generate.py); do not edit."""
