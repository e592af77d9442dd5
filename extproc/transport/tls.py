"""Server TLS for the ext_proc port: a certificate from --cert-path, or a self-signed one.

`--cert-path DIR` reads DIR/tls.crt and DIR/tls.key (the Go EPP's layout, as mounted from a
Kubernetes TLS Secret). Without it, a self-signed certificate is generated at start-up, which a
proxy can only accept without verification (Envoy's reference configuration for the Go EPP);
`prefix-epp envoy-config --upstream-ca-file` and the Helm chart verify a CA-signed certificate
instead. ECDSA P-256 keys are used because they are generated in milliseconds (an RSA-4096 key
takes seconds on a small pod).

`--client-ca-file FILE` (PEM, one or more CA certificates) turns on mutual TLS: the handshake
fails unless the client presents a certificate one of them signed, so only a proxy holding such
a certificate (Envoy's cluster `tls_certificates`, `envoy-config --upstream-client-cert`) can
open an ext_proc stream and see prompts. Without it any client that reaches the port may.

`check_files` reads and parses all of them at start-up (a missing or unreadable file, a file that
is not PEM, a key that does not match the certificate), so that `prefix-epp serve` refuses them in
one line naming the flag instead of gRPC failing to bind, or failing every handshake later.

Peer sync over TLS (`--sync-tls`, `peer_tls`) needs `--cert-path`: every replica serves the same
certificate and verifies its peers' against DIR/ca.crt when the Secret has one, else against
tls.crt itself (the replicas share it), under the certificate's first DNS name (peers are dialled
by pod IP, so the name is pinned rather than taken from the address).
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def self_signed(common_name: str = "prefix-epp", days: int = 3650) -> tuple[bytes, bytes]:
    """Return (key_pem, cert_pem) of a new self-signed certificate."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    san = x509.SubjectAlternativeName([
        x509.DNSName(common_name), x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(san, critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


def check_files(cert_path: str, client_ca_file: str = "") -> str | None:
    """What is wrong with --cert-path's tls.crt and tls.key, or --client-ca-file, naming the flag; None: nothing."""
    if cert_path:
        directory = Path(cert_path)
        try:
            cert_pem, key_pem = (directory / "tls.crt").read_bytes(), (directory / "tls.key").read_bytes()
        except OSError as exc:
            return f"--cert-path {cert_path}: cannot read {exc.filename}: {exc.strerror}"
        try:
            cert = x509.load_pem_x509_certificate(cert_pem)
        except ValueError:
            return f"--cert-path {cert_path}: tls.crt is not a PEM certificate"
        try:
            key = serialization.load_pem_private_key(key_pem, password=None)
        except (ValueError, TypeError):
            return f"--cert-path {cert_path}: tls.key is not an unencrypted PEM private key"
        if key.public_key().public_bytes(*_SPKI) != cert.public_key().public_bytes(*_SPKI):
            return f"--cert-path {cert_path}: tls.key is not the key of tls.crt"
    if client_ca_file:
        try:
            x509.load_pem_x509_certificates(Path(client_ca_file).read_bytes())
        except OSError as exc:
            return f"--client-ca-file {client_ca_file}: cannot read it: {exc.strerror}"
        except ValueError:
            return f"--client-ca-file {client_ca_file}: not a PEM CA certificate bundle"
    return None


_SPKI = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def server_credentials(cert_path: str, client_ca_file: str = "") -> grpc.ServerCredentials:
    """The ext_proc port's credentials; with `client_ca_file`, clients must present a certificate."""
    if cert_path:
        directory = Path(cert_path)
        key_pem = (directory / "tls.key").read_bytes()
        cert_pem = (directory / "tls.crt").read_bytes()
    else:
        key_pem, cert_pem = self_signed()
    if not client_ca_file:
        return grpc.ssl_server_credentials([(key_pem, cert_pem)])
    client_ca = Path(client_ca_file).read_bytes()
    if b"-----BEGIN CERTIFICATE-----" not in client_ca:
        raise ValueError(f"--client-ca-file {client_ca_file}: no PEM certificate in the file")
    return grpc.ssl_server_credentials([(key_pem, cert_pem)], root_certificates=client_ca, require_client_auth=True)


def peer_tls(cert_path: str) -> tuple[grpc.ServerCredentials, grpc.ChannelCredentials, str]:
    """(server credentials, channel credentials, expected server name) for peer sync over TLS."""
    if not cert_path:
        raise ValueError("--sync-tls needs --cert-path: peers verify each other's certificate")
    directory = Path(cert_path)
    key_pem = (directory / "tls.key").read_bytes()
    cert_pem = (directory / "tls.crt").read_bytes()
    ca = directory / "ca.crt"
    roots = ca.read_bytes() if ca.is_file() and ca.stat().st_size else cert_pem
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName)
    except x509.ExtensionNotFound:
        names = []
    cn = [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if not names and not cn:
        raise ValueError(f"{directory / 'tls.crt'} names no host (no DNS subject alternative name, no CN)")
    return (grpc.ssl_server_credentials([(key_pem, cert_pem)]), grpc.ssl_channel_credentials(root_certificates=roots),
            (names or cn)[0])
