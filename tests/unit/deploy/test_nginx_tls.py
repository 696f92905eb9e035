"""The deploy bundle's TLS / HTTP/2 proxy: `nginx/llm-tls.conf` (TLS, `http2 on;`, the HTTP/1.1
keep-alive upstream), the compose profile `tls` that runs it, and `nginx -t` over both configs
(with a throwaway certificate, and `http2 on;` spelled for an nginx older than 1.25.1). That the
config really speaks HTTP/2 to a client is in tests/integration/test_serve_http2.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from llmopt.deploy import resolve_source, validate_bundle, write_bundle
from llmopt.deploy import templates as T
from llmopt.hardware.target import Target

CONFIG_8B = Path(__file__).parents[2] / "fixtures" / "configs" / "llama-3.1-8b"
NGINX = shutil.which("nginx")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("deploy-tls") / "llama8b"
    res = write_bundle(resolve_source(CONFIG_8B), out, Target.gpu_model("H200", 1))
    assert res.ok, [c.to_dict() for c in res.checks if c.status == "failed"]
    return out


def test_tls_conf_speaks_h2_to_clients_and_http11_upstream(bundle):
    tls = (bundle / "nginx" / "llm-tls.conf").read_text()
    for directive in (
        "listen 443 ssl;",
        "http2 on;",
        f"ssl_certificate     {T.NGINX_CERT_DIR}/tls.crt;",
        f"ssl_certificate_key {T.NGINX_CERT_DIR}/tls.key;",
        "proxy_http_version 1.1;",
        "proxy_buffering off;",
        "keepalive 32;",
    ):
        assert directive in tls, directive
    plain = (bundle / "nginx" / "llm.conf").read_text()
    assert "listen 80;" in plain and "ssl" not in plain and "http2" not in plain.split("\n", 3)[3]


def test_compose_runs_the_tls_proxy_only_in_its_profile(bundle):
    services = yaml.safe_load((bundle / "docker-compose.yml").read_text())["services"]
    assert "profiles" not in services["proxy"]  # `docker compose up` needs no certificate
    tls = services["proxy-tls"]
    assert tls["profiles"] == ["tls"] and tls["image"] == T.NGINX_IMAGE
    assert "./nginx/llm-tls.conf:/etc/nginx/conf.d/default.conf:ro" in tls["volumes"]
    assert f"${{TLS_CERT_DIR:-./nginx/certs}}:{T.NGINX_CERT_DIR}:ro" in tls["volumes"]
    assert tls["ports"] == ["${BIND_ADDR:-127.0.0.1}:${PROXY_TLS_PORT:-8443}:443"]
    readme = (bundle / "README.md").read_text()
    assert "--profile tls" in readme and "llm-tls.conf" in readme


@pytest.mark.skipif(NGINX is None, reason="nginx not installed (apt-get install nginx-light)")
def test_nginx_t_checks_both_configs(bundle, tmp_path):
    check = next(
        c
        for c in json.loads((bundle / "bundle.json").read_text())["checks"]
        if c["name"] == "nginx"
    )
    assert check["status"] == "passed"
    assert "llm.conf:" in check["detail"] and "llm-tls.conf:" in check["detail"]
    broken = tmp_path / "b"
    shutil.copytree(bundle, broken)
    tls = broken / "nginx" / "llm-tls.conf"
    tls.write_text(tls.read_text().replace("ssl_protocols TLSv1.2", "ssl_protocols TLSv9"))
    results = {r.name: r for r in validate_bundle(broken)}
    assert results["nginx"].status == "failed", results["nginx"].detail


@pytest.mark.parametrize("maker", ["cryptography", "openssl"])
def test_self_signed_cert_is_trusted_for_loopback(maker, tmp_path, monkeypatch):
    """The one throwaway certificate (`nginx -t`, the TLS serve tests, benchmarks/http2.py):
    a client given it as its CA completes a handshake for 127.0.0.1 and for localhost, with
    `cryptography` or, without it, the openssl command."""
    import socket
    import ssl
    import sys
    import threading

    from llmopt.deploy.validate import self_signed_cert

    if maker == "openssl":
        if shutil.which("openssl") is None:
            pytest.skip("no openssl command")
        monkeypatch.setitem(sys.modules, "cryptography", None)  # as if not installed
    crt, key = self_signed_cert(tmp_path, "cert.pem", "key.pem")
    assert (crt, key) == (tmp_path / "cert.pem", tmp_path / "key.pem")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(crt, key)
    client = ssl.create_default_context(cafile=str(crt))
    for host in ("127.0.0.1", "localhost"):
        a, b = socket.socketpair()
        with a, b:
            t = threading.Thread(target=_accept, args=(server, a))
            t.start()
            with client.wrap_socket(b, server_hostname=host) as tls:
                assert tls.version() is not None
            t.join(10)


def _accept(ctx, sock) -> None:
    ctx.wrap_socket(sock, server_side=True).close()  # the server's side of the handshake
