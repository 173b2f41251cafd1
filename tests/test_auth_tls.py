"""TCP is served only over TLS; with a CA configured, only clients with a certificate it signed get in,
and they get the profiler role (not the operator's)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from daemon_fixtures import bound_port, sim_daemon, start_logging_serving

from vgpu import auth
from vgpu.daemon.serve import Daemon
from vgpu.v1 import allocator_pb2 as pb
from vgpu.v1 import allocator_pb2_grpc as pb_grpc

OPENSSL = shutil.which("openssl")
pytestmark = pytest.mark.skipif(OPENSSL is None, reason="openssl is needed to make test certificates")


def _ssl(*args: str, cwd: Path) -> None:
    subprocess.run([OPENSSL, *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def make_pki(d: Path) -> None:
    """A CA, a server certificate for localhost and a client certificate, all signed by the CA."""
    _ssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1",
         "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=vgpu test CA", cwd=d)
    for name, ext in (("server", "subjectAltName=DNS:localhost,IP:127.0.0.1"), ("client", "extendedKeyUsage=clientAuth")):
        _ssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", f"/CN=vgpu-{name}", cwd=d)
        (d / f"{name}.ext").write_text(ext + "\n")
        _ssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "1", "-out", f"{name}.pem", "-extfile", f"{name}.ext", cwd=d)


@pytest.fixture
async def tls_daemon(tmp_path: Path) -> AsyncIterator[tuple[Daemon, Path, int]]:
    pki = tmp_path / "pki"
    pki.mkdir()
    make_pki(pki)
    d = sim_daemon(tmp_path, **{
        "server.tcp": "127.0.0.1:auto", "tls.cert": str(pki / "server.pem"), "tls.key": str(pki / "server.key"),
        "tls.ca": str(pki / "ca.pem"),
    })
    serving = await start_logging_serving(d)
    try:
        port = bound_port(serving, "tcp")  # the kernel picked it at bind; the daemon says which
        yield d, pki, port
    finally:
        await d.stop("test")


def _channel(pki: Path, port: int, *, client_cert: bool) -> grpc.aio.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=(pki / "ca.pem").read_bytes(),
        private_key=(pki / "client.key").read_bytes() if client_cert else None,
        certificate_chain=(pki / "client.pem").read_bytes() if client_cert else None,
    )
    return grpc.aio.secure_channel(f"localhost:{port}", creds)


async def test_mutual_tls_client_is_a_profiler(tls_daemon: tuple[Daemon, Path, int]) -> None:
    d, pki, port = tls_daemon
    async with _channel(pki, port, client_cert=True) as ch:
        stub = pb_grpc.AllocatorStub(ch)
        resp = await stub.GetAvailableResources(pb.GetAvailableResourcesRequest(), timeout=10)
        assert len(resp.devices) == 1
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.SetResourceLimits(pb.SetResourceLimitsRequest(limits=pb.AppLimits(app_id="a")), timeout=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # A token still works over TLS and takes precedence over the certificate.
        token = d.state_dir / "tokens" / "operator.token"
        await stub.SetResourceLimits(pb.SetResourceLimitsRequest(limits=pb.AppLimits(app_id="a", max_sm_pct=10)),
                                     metadata=auth.bearer(token.read_text()), timeout=10)
    assert d.allocator.ledger.limits("a") is not None


async def test_clients_without_a_certificate_or_tls_are_refused(tls_daemon: tuple[Daemon, Path, int]) -> None:
    _d, pki, port = tls_daemon
    async with _channel(pki, port, client_cert=False) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await pb_grpc.AllocatorStub(ch).GetAvailableResources(pb.GetAvailableResourcesRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await pb_grpc.AllocatorStub(ch).GetAvailableResources(pb.GetAvailableResourcesRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
