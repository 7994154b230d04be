"""Optional TLS for the frontend: one certificate/key pair (PEM) serves HTTPS and gRPC.

    tls = TlsFiles.load(cert_file, key_file)   # fails at startup, naming the file, if unusable
    uvicorn.Config(..., **tls.uvicorn_kwargs())
    server.add_secure_port(addr, tls.grpc_credentials())

The pair is checked with the ssl module before anything listens, so a wrong path or a key that does
not match the certificate is a clear startup error rather than a failed handshake later. Rotating the
files needs a frontend restart (a Kubernetes Secret update rolls the Deployment via its checksum).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TlsFiles", "TlsConfigError"]


class TlsConfigError(ValueError):
    """The certificate or key cannot be used (missing, unreadable, not PEM, or not a pair)."""


@dataclass(frozen=True)
class TlsFiles:
    cert_file: Path
    key_file: Path
    cert_pem: bytes
    key_pem: bytes

    @classmethod
    def load(cls, cert_file: str | Path, key_file: str | Path) -> "TlsFiles":
        cert_file, key_file = Path(cert_file), Path(key_file)
        pems = []
        for what, path in (("certificate", cert_file), ("key", key_file)):
            try:
                pems.append(path.read_bytes())
            except OSError as exc:
                raise TlsConfigError(f"TLS {what} {path}: {exc.strerror or exc}") from exc
            if b"-----BEGIN " not in pems[-1]:
                raise TlsConfigError(f"TLS {what} {path}: not a PEM file")
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert_file, key_file)
        except (ssl.SSLError, OSError) as exc:
            raise TlsConfigError(f"TLS certificate {cert_file} and key {key_file} cannot be used together: {exc}") from exc
        return cls(cert_file, key_file, pems[0], pems[1])

    def uvicorn_kwargs(self) -> dict:
        return {"ssl_certfile": str(self.cert_file), "ssl_keyfile": str(self.key_file)}

    def grpc_credentials(self):
        import grpc

        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)])
