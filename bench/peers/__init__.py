"""Peer routers built from source (bench/peers/build.sh) and `compare`, prefix-epp against the Go picker.

The Go picker's setup is `bench.lib.go_epp`.
"""
