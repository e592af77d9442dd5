"""Peer sync: picker replicas share their prefix-index decisions, with no broker.

- `wire`: authenticated, compressed frames (the protocol).
- `admission`: every received frame checked off the event loop, a bounded share per sender.
- `replay`: the per-origin sequence window that refuses a frame seen before.
- `outbox`: where the request path's index listeners drop records; bounded, never blocks.
- `link`: one outgoing connection to a peer (bounded frame queue, reconnect, snapshot fetch).
- `service`: the gRPC service peers push to (Hello, Push, Snapshot).
- `manager`: `PeerSync`, wiring the above; follows the peer set (static or Kubernetes).
- `kube_peers`: the ready pods of the picker's own Deployment, by label selector.
- `metrics`: the `prefix_epp_sync_*` Prometheus collector.
"""
