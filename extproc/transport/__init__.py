"""The Envoy ext_proc gRPC server: stream state machine, responses, health, TLS."""
