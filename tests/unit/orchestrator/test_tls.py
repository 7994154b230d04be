"""TLS for HTTP (uvicorn, through the CLI's server setup) and gRPC (grpc.ssl_server_credentials), with a CA
and a server certificate made at test time (the `cryptography` package); API keys checked over both."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc.aio as tgrpc
from tritonclient.grpc import InferInput
from tritonclient.utils import InferenceServerException

from orchestrator.app import create_app
from orchestrator.cli import build_parser, frontend_config
from orchestrator.commands import _serve
from orchestrator.config import FrontendConfig
from orchestrator.security import KeyFile, TlsConfigError, TlsFiles, generate_key, save_key_file
from workers.discovery import InMemoryDiscovery

from orchestrator.testing import FakeEngine, free_port, winfo


def make_certs(folder: Path, hosts=("127.0.0.1", "localhost")) -> dict[str, Path]:
    """A CA, a server certificate it signed for `hosts`, and the server key (PEM files in `folder`)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvyard test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.IPAddress(ipaddress.ip_address(h)) if h[0].isdigit() else x509.DNSName(h) for h in hosts]
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = {"ca": folder / "ca.pem", "cert": folder / "server.pem", "key": folder / "server-key.pem"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    paths["key"].chmod(0o600)
    return paths


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, Path]:
    return make_certs(tmp_path_factory.mktemp("tls"))


def test_tls_files_are_checked_at_startup(certs, tmp_path):
    tls = TlsFiles.load(certs["cert"], certs["key"])
    assert tls.uvicorn_kwargs() == {"ssl_certfile": str(certs["cert"]), "ssl_keyfile": str(certs["key"])}
    other = make_certs(tmp_path)
    with pytest.raises(TlsConfigError, match="cannot be used together"):
        TlsFiles.load(certs["cert"], other["key"])  # a key that is not the certificate's
    with pytest.raises(TlsConfigError, match="missing.pem"):
        TlsFiles.load(tmp_path / "missing.pem", certs["key"])
    (tmp_path / "junk.pem").write_text("hello")
    with pytest.raises(TlsConfigError, match="not a PEM file"):
        TlsFiles.load(tmp_path / "junk.pem", certs["key"])
    with pytest.raises(TlsConfigError):  # create_app refuses to start on a bad pair
        create_app(FrontendConfig(grpc_port=0, security={"tls_cert_file": certs["cert"], "tls_key_file": other["key"]}))
    with pytest.raises(SystemExit, match="go together"):
        frontend_config(build_parser().parse_args(["frontend", "--tls-cert", str(certs["cert"])]))


async def test_https_frontend_with_api_key(certs, tmp_path):
    key, rec = generate_key("tls")
    save_key_file(tmp_path / "keys.yaml", KeyFile(keys=[rec]))
    port = free_port()
    ns = build_parser().parse_args(["frontend", "--port", str(port), "--grpc-port", "0", "--tls-cert", str(certs["cert"]),
                                     "--tls-key", str(certs["key"]), "--api-keys-file", str(tmp_path / "keys.yaml")])
    cfg = frontend_config(ns).model_copy(update={"refresh_interval_s": 60})
    disc = InMemoryDiscovery()
    app = create_app(cfg, disc)
    server = await _serve(app, cfg)  # the CLI's own server setup
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.02)
        with FakeEngine() as eng:
            await disc.register(winfo("a", eng.url), ttl_s=60)
            await app.state.pool.refresh()
            trust = ssl.create_default_context(cafile=str(certs["ca"]))
            async with httpx.AsyncClient(verify=trust, base_url=f"https://127.0.0.1:{port}") as c:
                assert (await c.get("/live")).json() == {"status": "ok"}
                r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
                r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2, "stream": True},
                                 headers={"authorization": f"Bearer {key}"})
                assert r.status_code == 200 and "[DONE]" in r.text
            async with httpx.AsyncClient() as untrusting:  # the system trust store does not know the test CA
                with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                    await untrusting.get(f"https://127.0.0.1:{port}/live")
            async with httpx.AsyncClient() as plain:  # plain HTTP to the TLS port gets no answer
                with pytest.raises(httpx.HTTPError):
                    await plain.get(f"http://127.0.0.1:{port}/live")
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


def _inputs(prompt: str = "hello") -> list[InferInput]:
    x = InferInput("text_input", [1], "BYTES")
    x.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    return [x]


async def test_grpc_over_tls_with_api_key(certs, tmp_path):
    key, rec = generate_key("grpc")
    save_key_file(tmp_path / "keys.yaml", KeyFile(keys=[rec]))
    port = free_port()
    cfg = FrontendConfig(grpc_port=port, refresh_interval_s=60, security={"tls_cert_file": certs["cert"], "tls_key_file": certs["key"], "api_keys_file": tmp_path / "keys.yaml"})
    disc = InMemoryDiscovery()
    app = create_app(cfg, disc)
    async with app.router.lifespan_context(app):
        with FakeEngine(tokens=4) as eng:
            await disc.register(winfo("a", eng.url), ttl_s=60)
            await app.state.pool.refresh()
            # a third-party client over TLS (tritonclient reads the CA from its path)
            client = tgrpc.InferenceServerClient(f"127.0.0.1:{port}", ssl=True, root_certificates=str(certs["ca"]))
            try:
                assert await client.is_server_live()  # probes need no key
                with pytest.raises(InferenceServerException) as ei:
                    await client.infer("m", _inputs())
                assert ei.value.status() == "StatusCode.UNAUTHENTICATED" and "API key" in ei.value.message()
                r = await client.infer("m", _inputs(), headers={"authorization": f"Bearer {key}"})
                assert r.as_numpy("text_output").tolist() == [b"xxxx"]
            finally:
                await client.close()
            # plain grpcio over TLS
            creds = grpc.ssl_channel_credentials(root_certificates=certs["ca"].read_bytes())
            async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds) as ch:
                from tritonclient.grpc import service_pb2 as triton_pb

                live = ch.unary_unary("/inference.GRPCInferenceService/ServerLive",
                                      request_serializer=triton_pb.ServerLiveRequest.SerializeToString,
                                      response_deserializer=triton_pb.ServerLiveResponse.FromString)
                assert (await live(triton_pb.ServerLiveRequest(), timeout=5)).live
            # no TLS: the handshake never completes
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                live = ch.unary_unary("/inference.GRPCInferenceService/ServerLive",
                                      request_serializer=triton_pb.ServerLiveRequest.SerializeToString,
                                      response_deserializer=triton_pb.ServerLiveResponse.FromString)
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await live(triton_pb.ServerLiveRequest(), timeout=3)
                assert ei.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
