"""Deployments: deploy.toml checked before anything starts, planned side by side, and `deltaserve up` for real: the
built-in model behind vllm-router, driven by the `openai` package: chat on one instance and agents on two replicas,
one replica killed with SIGKILL while requests run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
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


def instance(name: str, port: int, role: str | None = None, **extra) -> str:
    lines = [f"[instances.{name}]", 'device = "cpu"', f'served_model_name = "{role or name}"', f"port = {port}",
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


def test_up_routes_by_role_retries_on_a_replica_and_brings_a_killed_instance_back(tmp_path):
    """chat on one instance, agents on two replicas (round robin): each request lands on its role's instances; a
    replica killed with SIGKILL while requests run costs no request (the router retries them on the other replica);
    the supervisor brings it back and the router sends to it again."""
    ports = {"chat": free_port(), "agents1": free_port(), "agents2": free_port()}
    router_port, metrics_port = free_port(), free_port()
    path = tmp_path / "deploy.toml"
    path.write_text(f'[router]\nport = {router_port}\npolicy = "round_robin"\n\n[supervisor]\nmetrics_port = {metrics_port}\n'
                    f'log_dir = "{tmp_path / "logs"}"\nmax_restart_backoff_s = 1\n\n'
                    + instance("chat", ports["chat"]) + "\n"
                    + instance("agents1", ports["agents1"], "agents") + "\n"
                    + instance("agents2", ports["agents2"], "agents"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    up = subprocess.Popen([sys.executable, "-m", "deltaserve.cli", "up", str(path)], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    role_of = {"chat": "chat", "agents1": "agents", "agents2": "agents"}
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key="-", max_retries=0, timeout=300)

    def ask(role: str, text: str = "Hi") -> str:
        reply = client.chat.completions.create(model=role, messages=[{"role": "user", "content": text}],
                                               max_tokens=4, temperature=0)
        return reply.model

    def served(*names: str) -> dict[str, float]:
        return {name: metric(urls[name], "deltaserve_http_requests_total") for name in names or urls}

    try:
        wait_for(lambda: ask("chat") == "chat", 600, "the deployment to answer", up)
        # the front door: the router's own {"models": [...]} reaches clients as OpenAI's list (deploy/front.py)
        assert sorted(model.id for model in client.models.list().data) == ["agents", "chat"]
        for role in ("chat", "agents", "chat", "agents", "agents"):
            before = served()
            assert ask(role) == role
            after = served()
            grew = [name for name in urls if after[name] != before[name]]
            assert len(grew) == 1 and role_of[grew[0]] == role and after[grew[0]] == before[grew[0]] + 1, (role, grew)

        victim = httpx.get(urls["agents1"] + "/server_info", timeout=10, trust_env=False).json()
        assert victim["served_model_name"] == "agents"
        pid = _listener_pid(ports["agents1"])
        survivor_before = served("agents2")["agents2"]
        with ThreadPoolExecutor(6) as pool:
            running = [pool.submit(ask, "agents", f"Hi {i}") for i in range(6)]
            time.sleep(0.5)
            os.kill(pid, signal.SIGKILL)
            # not one request is lost: those not yet answered by the dead replica are retried on the other
            assert [f.result() for f in running] == ["agents"] * 6
        assert served("agents2")["agents2"] > survivor_before  # (the killed replica may not answer yet)
        assert ask("chat") == "chat"  # the chat role is untouched meanwhile
        wait_for(lambda: metric(f"http://127.0.0.1:{metrics_port}", 'deltaserve_deploy_restarts_total{instance="agents1"}') >= 1,
                 60, "the supervisor to count the restart", up)
        ready = f'deltaserve_deploy_instance_ready{{instance="agents1"}}'
        # the supervisor's own view: ready again once it has seen the new process answer (it logs "is back" then)
        wait_for(lambda: metric(f"http://127.0.0.1:{metrics_port}", ready) == 1, 600, "the killed replica to come back",
                 up)
        assert httpx.get(urls["agents1"] + "/health", timeout=5, trust_env=False).status_code == 200
        assert _listener_pid(ports["agents1"]) != pid

        def back_in_rotation() -> bool:
            before = served("agents1")["agents1"]
            ask("agents")
            return served("agents1")["agents1"] > before

        wait_for(back_in_rotation, 300, "the router to send to the restarted replica again", up)
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            output, _ = up.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            up.kill()
            output, _ = up.communicate()
    assert up.returncode == 0, output[-3000:]
    assert "agents1 exited" in output and "agents1 is back" in output, output[-3000:]
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
