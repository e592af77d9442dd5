"""prefix-epp: a prefix-cache-aware Endpoint Picker for Envoy ext_proc.

Rooms, lowest first; a room imports only rooms below it (tests/test_layering.py holds this):

| room | what it holds |
|---|---|
| `pb` | generated protobuf and gRPC code (ext_proc, health) |
| `config` | every default (`settings`), the flag table (`flags`), start-up validation (`validate`) |
| `core` | the datastore of endpoints, error codes, structured logs, supervised background tasks |
| `request` | the OpenAI-style body parsed into what scheduling reads |
| `prefix` | the approximate prefix index: block hashing, the per-endpoint LRU, capacity tuning |
| `tokenization` | request -> engine token ids (builtin, tokenizer.json, remote; chunking and caching) |
| `kvevents` | precise routing from the engines' KV events (ZeroMQ subscriptions, the precise index) |
| `discovery` | InferencePool, Pod and InferenceObjective watches; static endpoints |
| `scraping` | model-server /metrics scraped into the datastore |
| `sync` | peer sync of the prefix index between picker replicas |
| `scheduling` | filters, scorers (one file each), pickers, the scheduler and its latency model |
| `flowcontrol` | requests held while the pool is saturated: priority bands, fairness flows, TTLs |
| `control` | request control: the director, affinity hints, the closed loop on reported usage |
| `telemetry` | the picker's own Prometheus metrics and their /metrics endpoint |
| `transport` | the ext_proc gRPC transport: the stream state machine, responses, health, TLS |
| `runtime` | process wiring: the app, worker processes, drain |
| `sidecar` | the decode pod's prefill/decode proxy (`prefix-epp sidecar`): prefill elsewhere, then decode here |
| `commands` | the CLI: `serve`, `envoy-config`, `sidecar`, `sim` (the simulator, package `prefix_epp_sim`) |

Data flows one way on the request path: transport -> control (parse, tokenize) -> [flowcontrol:
wait for a turn while the pool is saturated] -> scheduling -> decision -> transport. Discovery,
scraping, KV events and sync fill the datastore and the indexes in the background; the request
path only reads them.
"""
