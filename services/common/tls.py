"""Optional TLS on every link: the settings every service shares (its certificate,
its key and the CA it trusts) and what is built from them, once, for everyone:
gRPC server credentials, gRPC channels and the gateway's REST server.

A service with a certificate serves TLS. With a CA as well, the mesh's internal
gRPC servers (scheduler, workers, KV store) accept only clients that present a
certificate signed by that CA (mutual TLS), and every service shows its own
certificate when it calls another. The gateway's public endpoints (REST and
`yinian.v1.Inference`) serve TLS without asking product clients for one.
Without a certificate everything is plaintext, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from basis.flags import setting
from services.common import mesh_token
from services.common.entry import StartupError


@dataclass(frozen=True, slots=True)
class TlsFiles:
    cert: str
    key: str
    ca: str = ""

    def _pem(self) -> tuple[bytes, bytes, bytes | None]:
        # Read at each use (a server or a channel is made once): rotated files are
        # picked up by the next channel.
        read = lambda path: Path(path).read_bytes()  # noqa: E731
        return read(self.cert), read(self.key), read(self.ca) if self.ca else None

    def server_credentials(self, require_client_cert: bool = True) -> grpc.ServerCredentials:
        cert, key, ca = self._pem()
        mutual = bool(ca and require_client_cert)
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=mutual
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self._pem()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                            certificate_chain=cert)  # fmt: skip

    def uvicorn_options(self) -> dict:
        """uvicorn.Config's TLS arguments for a public REST server."""
        return {"ssl_certfile": self.cert, "ssl_keyfile": self.key}


@dataclass(slots=True, kw_only=True)
class TlsSettings:
    """Mixed into every service's config (keyword-only, so it follows required fields)."""

    tls_cert: str = setting(
        "", "this service's certificate (PEM): served to clients and shown to services it calls"
    )
    tls_key: str = setting("", "the private key of --tls-cert (PEM)")
    tls_ca: str = setting(
        "",
        "CA certificate(s) (PEM) that peers must be signed by; with it, internal gRPC servers "
        "require client certificates (mutual TLS)",
    )

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_ca and not self.tls_cert:
            raise ValueError("--tls-ca needs --tls-cert and --tls-key (mutual TLS)")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ValueError(f"--{name.replace('_', '-')}: no file {path}")

    def tls_files(self) -> TlsFiles | None:
        if not self.tls_cert:
            return None
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_ca)


def aio_channel(address: str, tls: TlsFiles | None, options=()) -> grpc.aio.Channel:
    """An asyncio channel to `address`: TLS (with our certificate) or plaintext;
    its calls carry the mesh's token (services/common/mesh_token.py)."""
    hooks = mesh_token.aio_interceptors()
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=hooks)
    creds = tls.channel_credentials()
    return grpc.aio.secure_channel(address, creds, options=list(options), interceptors=hooks)


def sync_channel(address: str, tls: TlsFiles | None, options=()) -> grpc.Channel:
    """A blocking channel (tools and tests), the same way."""
    if tls is None:
        return mesh_token.sync_intercept(grpc.insecure_channel(address, options=list(options)))
    channel = grpc.secure_channel(address, tls.channel_credentials(), options=list(options))
    return mesh_token.sync_intercept(channel)


def check_readable(tls: TlsFiles | None) -> None:
    """Reads the files now, so a bad path or PEM stops the service at start."""
    if tls is None:
        return
    try:
        tls.server_credentials()
    except (OSError, ValueError, RuntimeError) as exc:
        raise StartupError(f"TLS files unusable: {exc}") from None
