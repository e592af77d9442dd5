"""The picker's own Prometheus metrics: requests and decisions (`epp`), the latency model
(`latency`), KV events (`kv_events`), peer sync (`sync`), bounded model labels (`labels`), the
/metrics endpoint (`http`) and its merge across worker processes (`pod`)."""
