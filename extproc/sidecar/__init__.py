"""The prefill/decode sidecar (`prefix-epp sidecar`): a small proxy in front of a decode engine.

In a disaggregated pool the picker sends a request to a decode pod and, when the prompt's uncached
part there is long, names a prefill pod in `x-prefiller-host-port`. This proxy, listening on the
decode pod's target port, runs the prefill there, then the decode on its own engine, and streams
the decode's answer back; without the header it forwards the request as it is. It is a process of
its own, beside the engine: it reads only its configuration (extproc/config/sidecar.py) and the
structured logs of `core`, nothing of the picker's scheduling.

- `protocol`: the two requests' bodies and headers (llm-d's `nixlv2` and `shared-storage`), pure;
- `proxy`: the request handling and its error answers;
- `metrics`: its own counters, on `--metrics-port`;
- `server`: listeners, the outbound pool, graceful stop.
"""
