"""`llmopt serve --http2` and `--ssl-certfile/--ssl-keyfile` before anything is served: hypercorn
missing (a real import failure, through a PYTHONPATH shim) is a clear error with the install
command, given before the model loads; TLS flags are checked; the external engines refuse them;
the hypercorn configuration follows the settings."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmopt.serve.settings import ServeSettings

SRC = Path(__file__).parents[3] / "src"


def _serve(args: list[str], extra_path: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (extra_path, SRC) if p)
    cmd = [sys.executable, "-m", "llmopt.cli.main", "serve", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)


def test_http2_without_hypercorn_says_how_to_install(tiny_llama_dir, tmp_path):
    shim = tmp_path / "shim" / "hypercorn"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'hypercorn'\", name='hypercorn')\n"
    )
    t0 = time.monotonic()
    p = _serve([str(tiny_llama_dir), "--http2", "--port", "0"], tmp_path / "shim")
    assert p.returncode == 2, p.stderr[-2000:]
    err = " ".join(p.stderr.split())
    assert "--http2 needs the hypercorn server" in err
    assert "pip install 'llmopt[serve]'" in err and "pip install hypercorn h2" in err
    assert "serving" not in err and "Traceback" not in err
    assert time.monotonic() - t0 < 120  # refused before the model loads


def test_tls_flags_are_checked(tiny_llama_dir, tmp_path):
    cert = tmp_path / "cert.pem"
    cert.write_text("not read before the key is given")
    p = _serve([str(tiny_llama_dir), "--ssl-certfile", str(cert)])
    assert p.returncode == 2 and "--ssl-keyfile" in p.stderr
    p = _serve(
        [str(tiny_llama_dir), "--ssl-certfile", str(cert), "--ssl-keyfile", str(tmp_path / "no")]
    )
    assert p.returncode == 2 and "no such file" in " ".join(p.stderr.split())
    p = _serve([str(tiny_llama_dir), "--engine", "vllm", "--http2", "--dry-run"])
    assert p.returncode == 2 and "llmopt's own server" in " ".join(p.stderr.split())


def test_settings_validation(tmp_path):
    with pytest.raises(ValueError, match="both --ssl-certfile"):
        ServeSettings(ssl_keyfile=str(tmp_path))
    with pytest.raises(ValueError, match="no such file"):
        ServeSettings(ssl_certfile=str(tmp_path / "a"), ssl_keyfile=str(tmp_path / "b"))
    (tmp_path / "a").write_text("x")
    (tmp_path / "b").write_text("x")
    s = ServeSettings(ssl_certfile=str(tmp_path / "a"), ssl_keyfile=str(tmp_path / "b"))
    assert s.scheme == "https" and ServeSettings().scheme == "http"
    assert ServeSettings().http2 is False and ServeSettings().host == "127.0.0.1"


def test_hypercorn_config_follows_the_settings(tmp_path):
    pytest.importorskip("hypercorn")
    from llmopt.serve.hypercorn_server import make_config

    class Ctx:  # make_config reads only the settings
        settings = ServeSettings(host="::1", port=8123, max_num_seqs=8, max_queue=300)

    cfg = make_config(Ctx(), "warning")
    assert cfg.bind == ["[::1]:8123"] and not cfg.ssl_enabled
    assert cfg.alpn_protocols == ["h2", "http/1.1"]
    assert cfg.h2_max_concurrent_streams == 309  # every admitted request, and the 429 one
    (tmp_path / "c").write_text("x")
    (tmp_path / "k").write_text("x")
    Ctx.settings = ServeSettings(ssl_certfile=str(tmp_path / "c"), ssl_keyfile=str(tmp_path / "k"))
    cfg = make_config(Ctx(), "info")
    assert cfg.ssl_enabled and cfg.bind == ["127.0.0.1:8000"]
    assert cfg.h2_max_concurrent_streams == 100  # hypercorn's default is the floor
