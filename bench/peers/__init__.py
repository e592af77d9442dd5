"""Peer routers built from source (bench/peers/build.sh) and the setups that run them."""
