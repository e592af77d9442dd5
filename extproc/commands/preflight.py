"""What `prefix-epp serve` checks after its values are valid and before it opens anything: the
TLS files can be read and used, and every port it will listen on can be bound.

Without it a certificate that cannot be read, or a port another process holds, surfaces as gRPC's
own log lines and a Python traceback. Here each is one `StartupError` naming the flag:
`--grpc-port 9002: address already in use on 0.0.0.0; choose a free port or stop the process
holding it`.

- `tls_problem`: --cert-path's tls.crt and tls.key (for --secure-serving or --sync-tls) and
  --client-ca-file, read and parsed (extproc/transport/tls.py `check_files`).
- `listeners`: (flag, address flag, address, port) of each listener: ext_proc (--grpc-port),
  health (--grpc-health-port), /metrics (--metrics-port, unless 0), peer sync (--sync-port, unless 0).
- `kube_problem`: with --pool-name, the Kubernetes client configuration loads.
- `bind_problem`: binds the address and port as the servers will (SO_REUSEADDR), then lets go.
  A port taken between this check and the servers' own bind is still reported by flag
  (extproc/config/validate.py `bind_message`, from extproc/transport/grpc_server.py and
  extproc/runtime/app.py), after
  gRPC's own log line. Worker processes (--workers > 1) skip the check: their supervisor made it
  before starting them, and they share the ext_proc port with each other.
"""

from __future__ import annotations

import socket

from extproc.config.settings import EppConfig
from extproc.config.validate import StartupError, bind_message


def listeners(config: EppConfig) -> list[tuple[str, str, str, int]]:
    """(port flag, address flag, address, port) of every port `serve` listens on."""
    def address_flag(own: str, address: str) -> str:
        return own if address else "--bind-address"

    out = [("--grpc-port", "--bind-address", config.bind_address, config.grpc_port),
           ("--grpc-health-port", address_flag("--health-bind-address", config.health_bind_address),
            config.listen_address("health"), config.grpc_health_port)]
    if config.metrics_port:
        out.append(("--metrics-port", address_flag("--metrics-bind-address", config.metrics_bind_address),
                    config.listen_address("metrics"), config.metrics_port))
    if config.sync.port:
        out.append(("--sync-port", address_flag("--sync-bind-address", config.sync_bind_address),
                    config.listen_address("sync"), config.sync.port))
    return out


def bind_problem(flag: str, address_flag: str, address: str, port: int) -> str | None:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError as exc:
            return bind_message(flag, address_flag, address, port, exc)
    return None


def tls_problem(config: EppConfig) -> str | None:
    from extproc.transport.tls import check_files

    uses_cert = config.secure_serving or config.sync.tls
    return check_files(config.cert_path if uses_cert else "", config.client_ca_file)


def kube_problem(config: EppConfig) -> str | None:
    """With --pool-name: whether a Kubernetes client configuration loads (--kubeconfig, KUBECONFIG,
    the in-cluster service account or ~/.kube/config); without one discovery could never start."""
    if not config.pool_name:
        return None
    from extproc.discovery.kubernetes import api_client

    try:
        api_client(config.kubeconfig).close()  # type: ignore[no-untyped-call]
    except Exception as exc:  # kubernetes' ConfigException, or an unreadable file
        reason = " ".join(str(exc).split())[:200]
        return (f"--pool-name {config.pool_name}: no Kubernetes API to watch it ({reason}); run in a cluster, "
                "or give --kubeconfig FILE (or KUBECONFIG)")
    return None


def check(config: EppConfig) -> None:
    """Raise a StartupError on the first TLS file, Kubernetes configuration or listening port that
    cannot be used."""
    if problem := tls_problem(config):
        raise StartupError(problem)
    if problem := kube_problem(config):
        raise StartupError(problem)
    for listener in listeners(config):
        if problem := bind_problem(*listener):
            raise StartupError(problem)
