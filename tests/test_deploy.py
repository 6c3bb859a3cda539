"""Deployments: deploy.toml checked before anything starts, planned side by side, and `deltaserve up` for real: two
instances of the built-in model with different roles behind vllm-router, driven by the `openai` package, one of
them killed with SIGKILL while requests run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from server_util import free_port

ROOT = Path(__file__).resolve().parent.parent
FIELD = ROOT / "docs" / "deploy" / "field-two-gpus.toml"


def plan(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltaserve.cli", "plan", str(path)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


def instance(name: str, port: int, **extra) -> str:
    lines = [f"[instances.{name}]", 'device = "cpu"', f'served_model_name = "{name}"', f"port = {port}",
             "max_total_tokens = 2048", "max_running_requests = 4", "max_queue = 8"]
    lines += [f"{k} = {v!r}".replace("'", '"') for k, v in extra.items()]
    return "\n".join(lines) + "\n"


BAD_FILES = {
    "unknown key": (instance("chat", 9101) + "max_total_tokenz = 5\n", ":8: unknown key 'max_total_tokenz'"),
    "port clash": (instance("chat", 9101) + instance("agents", 9101), ":11: port 9101 of instances.agents"),
    "router port clash": ("[router]\nport = 9101\n" + instance("chat", 9101), ":2: port 9101 of router"),
    "bad value": (instance("chat", 9101, mem_fraction=1.5), "--mem-fraction 1.5 is out of range"),
    "no port": ("[instances.chat]\ndevice = \"cpu\"\n", "instances.chat has no port"),
    "not toml": ("[instances.chat\nport = 1\n", "not valid TOML"),
    "no instances": ("[router]\nport = 9100\n", "no instances"),
    # each fits an 8 GiB device alone (~5.6 GiB at 16-bit KV), the two together do not
    "overcommitted": (instance("chat", 9101, mem_fraction=0.9, device_memory="8GiB").replace("2048", "200000")
                      + instance("agents", 9102, mem_fraction=0.9, device_memory="8GiB").replace("2048", "200000"),
                      "device cpu is overcommitted"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_deploy_file_is_one_line_exit_2(tmp_path, case):
    text, expected = BAD_FILES[case]
    path = tmp_path / "deploy.toml"
    path.write_text(text)
    result = plan(path)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and str(path) in lines[0], result.stderr


def test_up_refuses_a_bad_file_and_starts_nothing(tmp_path):
    port = free_port()
    path = tmp_path / "deploy.toml"
    path.write_text(instance("chat", port) + instance("agents", port))
    result = subprocess.run([sys.executable, "-m", "deltaserve.cli", "up", str(path)], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2 and "port" in result.stderr
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False)


def test_field_deployment_plans_both_gpus():
    result = plan(FIELD)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "chat" in out and "agents" in out and "cuda:0" in out and "cuda:1" in out
    pool_row = next(line for line in out.splitlines() if line.startswith("KV pool (tokens)"))
    assert pool_row.split()[-2:] == ["133,120", "159,744"]  # the field's exact pools, as --max-total-tokens


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def wait_for(predicate, timeout_s: float, what: str, process: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process is None or process.poll() is None, f"`deltaserve up` exited while waiting for {what}"
        try:
            value = predicate()
            if value:
                return value
        except (httpx.HTTPError, openai.APIError):
            pass
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}")


def test_up_routes_by_role_and_brings_a_killed_instance_back(tmp_path):
    ports = {"chat": free_port(), "agents": free_port()}
    router_port, metrics_port = free_port(), free_port()
    path = tmp_path / "deploy.toml"
    path.write_text(f'[router]\nport = {router_port}\n\n[supervisor]\nmetrics_port = {metrics_port}\n'
                    f'log_dir = "{tmp_path / "logs"}"\nmax_restart_backoff_s = 1\n\n'
                    + instance("chat", ports["chat"]) + "\n" + instance("agents", ports["agents"]))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    up = subprocess.Popen([sys.executable, "-m", "deltaserve.cli", "up", str(path)], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    urls = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key="-", max_retries=0, timeout=120)

    def ask(role: str) -> str:
        reply = client.chat.completions.create(model=role, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4, temperature=0)
        return reply.model

    try:
        wait_for(lambda: ask("chat") == "chat", 600, "the deployment to answer", up)
        for role in ("chat", "agents", "chat", "agents"):
            before = {r: metric(u, "deltaserve_http_requests_total") for r, u in urls.items()}
            assert ask(role) == role
            after = {r: metric(u, "deltaserve_http_requests_total") for r, u in urls.items()}
            assert after[role] == before[role] + 1 and all(after[r] == before[r] for r in urls if r != role)

        victim = httpx.get(urls["agents"] + "/server_info", timeout=10, trust_env=False).json()
        assert victim["served_model_name"] == "agents"
        pid = _listener_pid(ports["agents"])
        os.kill(pid, signal.SIGKILL)
        # a request for the dead role meanwhile: answered (by the restarted instance) or a clean error, never a hang
        started = time.monotonic()
        try:
            assert ask("agents") == "agents"
        except openai.APIStatusError as e:
            assert e.status_code >= 500 and e.message, e
        assert time.monotonic() - started < 120
        # the chat role is untouched meanwhile
        assert ask("chat") == "chat"
        wait_for(lambda: metric(f"http://127.0.0.1:{metrics_port}", 'deltaserve_deploy_restarts_total{instance="agents"}') >= 1,
                 60, "the supervisor to count the restart", up)
        wait_for(lambda: ask("agents") == "agents", 600, "the restarted instance to answer through the router", up)
        assert _listener_pid(ports["agents"]) != pid
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            output, _ = up.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            up.kill()
            output, _ = up.communicate()
    assert up.returncode == 0, output[-3000:]
    assert "agents exited" in output and "agents is back" in output, output[-3000:]
    for url in urls.values():
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=2, trust_env=False)


def _listener_pid(port: int) -> int:
    """The pid of the process listening on 127.0.0.1:port (from /proc: the socket's inode, then its owner)."""
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and int(fields[1].split(":")[1], 16) == port:
            inode = fields[9]
    assert inode is not None, f"nothing listens on port {port}"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) == f"socket:[{inode}]" for fd in (proc / "fd").iterdir()):
                return int(proc.name)
        except OSError:
            continue
    raise AssertionError(f"no process owns the socket of port {port}")
