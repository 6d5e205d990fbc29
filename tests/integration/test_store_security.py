"""Store security: the admin token on RegisterAdapter/DeleteAdapter, TLS and mutual TLS."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraplex.v1 import adapter_store_pb2 as pb
from loraplex.v1 import adapter_store_pb2_grpc as pb_grpc
from tests.support.store_helpers import start_store, store_stub

ADMIN = "s3cret-admin-token"


@pytest.fixture(scope="module")
def good(tiny_llama_path, adapter_factory) -> Path:
    return adapter_factory(tiny_llama_path, "store-sec", r=4)


def test_admin_token_guards_register_and_delete_only(tmp_path, good):
    with (
        start_store(tmp_path / "cache", env={"LORAPLEX_ADMIN_TOKEN": ADMIN}) as proc,
        store_stub(proc.address) as stub,
    ):
        request = pb.RegisterAdapterRequest(name="guarded", source=str(good))
        for metadata, code in (
            ((), grpc.StatusCode.UNAUTHENTICATED),
            ((("authorization", "Basic abc"),), grpc.StatusCode.UNAUTHENTICATED),
            ((("authorization", "Bearer wrong"),), grpc.StatusCode.PERMISSION_DENIED),
        ):
            with pytest.raises(grpc.RpcError) as e:
                stub.RegisterAdapter(request, metadata=metadata, timeout=30)
            assert e.value.code() == code
            with pytest.raises(grpc.RpcError) as e:
                stub.DeleteAdapter(pb.DeleteAdapterRequest(name="guarded"), metadata=metadata, timeout=30)
            assert e.value.code() == code
        auth = (("authorization", f"Bearer {ADMIN}"),)
        record = stub.RegisterAdapter(request, metadata=auth, timeout=60)
        # Reads stay open without a token.
        assert stub.GetAdapter(pb.GetAdapterRequest(name="guarded")).digest == record.digest
        assert [a.name for a in stub.ListAdapters(pb.ListStoreAdaptersRequest()).adapters] == ["guarded"]
        assert len(list(stub.PullAdapter(pb.PullAdapterRequest(name="guarded")))) >= 2
        assert stub.DeleteAdapter(pb.DeleteAdapterRequest(name="guarded"), metadata=auth).deleted
        assert ADMIN not in proc.output()  # never logged


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl."""
    d = tmp_path_factory.mktemp("pki")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=loraplex-test-ca",
        cwd=d,
    )
    for who, ext in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{who}.key",
            "-out",
            f"{who}.csr",
            "-subj",
            f"/CN=loraplex-{who}",
            cwd=d,
        )
        (d / f"{who}.ext").write_text(ext + "\n")
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{who}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{who}.pem",
            "-days",
            "2",
            "-extfile",
            f"{who}.ext",
            cwd=d,
        )
    return d


def _health(address: str, credentials: grpc.ChannelCredentials | None) -> int:
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_tls(tmp_path, pki, good):
    creds = grpc.ssl_channel_credentials(root_certificates=(pki / "ca.pem").read_bytes())
    flags = ("--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"))
    with start_store(tmp_path / "cache", *flags, credentials=creds) as proc:
        with grpc.secure_channel(proc.address, creds) as ch:
            record = pb_grpc.AdapterStoreStub(ch).RegisterAdapter(
                pb.RegisterAdapterRequest(name="over-tls", source=str(good)), timeout=60
            )
            assert record.name == "over-tls"
        with pytest.raises(grpc.RpcError):
            _health(proc.address, None)  # plaintext is refused


def test_mutual_tls_needs_a_client_certificate(tmp_path, pki):
    root = (pki / "ca.pem").read_bytes()
    with_cert = grpc.ssl_channel_credentials(
        root, (pki / "client.key").read_bytes(), (pki / "client.pem").read_bytes()
    )
    flags = (
        "--tls-cert",
        str(pki / "server.pem"),
        "--tls-key",
        str(pki / "server.key"),
        "--tls-ca",
        str(pki / "ca.pem"),
    )
    with start_store(tmp_path / "cache", *flags, credentials=with_cert) as proc:
        assert _health(proc.address, with_cert) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError):
            _health(proc.address, grpc.ssl_channel_credentials(root))
