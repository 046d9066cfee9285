"""`rapid serve` as a command: options, the API key from the environment, a collection read
from disk and indexed at start, and a clean exit on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from rapid_integrations.cli import EXIT_USAGE, build_parser, main
from rapid_integrations.serve.server import DEFAULT_HOST, DEFAULT_PORT, settings_from
from tests.serve_fixtures import DTYPE


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_defaults_and_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAPID_API_KEY", raising=False)
    args = parse()
    assert (args.host, args.port, args.model, args.ray) == (DEFAULT_HOST, DEFAULT_PORT, None, False)
    settings = settings_from(args)
    assert settings.api_key is None and settings.model is None
    monkeypatch.setenv("RAPID_API_KEY", "from-env")
    settings = settings_from(parse("--collection", "docs=/tmp/docs", "--max-running", "2"))
    assert settings.api_key == "from-env"
    assert settings.collections == (("docs", "/tmp/docs"),) and settings.max_running == 2
    assert settings_from(parse("--api-key", "given")).api_key == "given"
    with pytest.raises(SystemExit, match="NAME=PATH"):
        settings_from(parse("--collection", "nameless"))


@pytest.mark.parametrize(
    ("option", "value"),
    [("--max-running", "0"), ("--max-waiting", "-1"), ("--request-timeout", "0")],
)
def test_bad_server_options_exit_2_naming_the_field(option: str, value: str, capsys) -> None:
    assert main(["serve", option, value]) == EXIT_USAGE
    assert option.lstrip("-").replace("-", "_") in capsys.readouterr().err


def test_the_command_serves_and_exits_cleanly_on_sigterm(
    served_model_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "manual").mkdir()
    (tmp_path / "manual" / "a.txt").write_text("a jade cab faded by the lake. " * 30)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RAPID_API_KEY": "k3y", "HF_HUB_OFFLINE": "1"}
    argv = [
        "serve",
        "--model",
        str(served_model_dir),
        "--dtype",
        DTYPE,
        "--device",
        "cpu",
        "--port",
        str(port),
    ]
    argv += ["--collection", f"manual={tmp_path / 'manual'}", "--served-model-name", "tiny"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "rapid_integrations.cli", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.ConnectError:
                pass
            assert time.monotonic() < deadline, "rapid serve did not start"
            time.sleep(0.2)
        assert httpx.get(url + "/v1/models").status_code == 401
        key = {"Authorization": "Bearer k3y"}
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "where is the cab?"}],
            "max_tokens": 4,
            "collection": "manual",
        }
        r = httpx.post(url + "/v1/chat/completions", json=body, headers=key, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] > 30 * 30  # the document was put before the chat
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    # uvicorn shuts down gracefully, then re-raises the signal (exit status -SIGTERM).
    assert proc.returncode in (0, -signal.SIGTERM), err
    assert "serving 'tiny'" in err and "Finished server process" in err
