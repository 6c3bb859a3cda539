"""`deltaserve serve` refuses bad settings, a busy port and a model it cannot load with one line and exit code 2."""

import socket
import subprocess
import sys

from server_util import free_port


def _serve(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltaserve.server.serve", "--log-level", "warning", *args],
                          capture_output=True, text=True, timeout=timeout_s)


def _one_error_line(done: subprocess.CompletedProcess, *fragments: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("deltaserve serve: error:")]
    assert len(errors) == 1, done.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def test_missing_model_path_is_refused_before_listening(tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    _one_error_line(_serve("--port", str(free_port()), "--model", str(missing)), str(missing), "no such file")


def test_bad_setting(tmp_path):
    _one_error_line(_serve("--port", str(free_port()), "--mem-fraction", "1.5"), "--mem-fraction")


def test_port_in_use():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        _one_error_line(_serve("--port", str(port)), f"--port {port}", "cannot listen")


def test_unsupported_model_stops_the_server(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "not-a-model", "architectures": ["Nope"]}')
    done = _serve("--port", str(free_port()), "--model", str(tmp_path))
    _one_error_line(done, "not-a-model")
