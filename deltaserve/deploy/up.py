"""`deltaserve up deploy.toml`: start every instance as its own process, put vllm-router in front, keep them running.

Each instance is `deltaserve serve` with its table's flags, logging to its own file. `up` waits until each answers
GET /health 200, then starts the router (vllm-router in its multi-model mode) on an internal port and registers each
instance with it; the router routes requests by their `model` to the instances of that role. On the public port
([router] port) runs deploy/front.py, a pass-through that only rewrites the router's GET /v1/models into OpenAI's
list shape.
A crashed instance is started again after a backoff that doubles per restart (1 s .. max_restart_backoff_s), its
restarts counted in the log and in Prometheus (`deltaserve_deploy_restarts_total{instance}`) when
[supervisor] metrics_port is set, and registered again; `deltaserve_deploy_instance_ready{instance}` there is 1 from
when the supervisor sees an instance answer /health 200 until it sees the instance exit. Ctrl-C or SIGTERM stops
the router and sends SIGTERM to every instance, which drains (each ends its streams within its --shutdown-timeout),
then exits 0.

Why vllm-router: both routers install from PyPI as binary wheels and both read /server_info, but sglang-router 0.3.2
ignores the request's model name in its regular mode, and its multi-model mode panics at start on a machine without
internet (it downloads a tokenizer vocabulary); vllm-router 0.1.17's multi-model mode routes by model name offline.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from deltaserve.deploy.plan import plan_deployment, report
from deltaserve.deploy.schema import Deployment, DeployError, Instance, load_deployment

HTTP = httpx.Client(trust_env=False)  # the instances and the router are local: never through a proxy
POLL_S = 0.5
# Beyond the longest instance --shutdown-timeout, before a stopped instance is killed: its cut streams' last events
# (server/drain.py CUT_GRACE_S), uvicorn's wait for slow readers (serve.py GRACEFUL_SHUTDOWN_S), stopping the engine.
STOP_GRACE_S = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("deploy_file", help="the deployment (deploy.toml): instances, router, supervisor")
    parser.add_argument("--no-router", action="store_true", help="start the instances only")


def run(args: argparse.Namespace) -> int:
    deployment = load_deployment(args.deploy_file)
    print(report(deployment, plan_deployment(deployment)), flush=True)
    supervisor = Supervisor(deployment, use_router=not args.no_router)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: supervisor.request_stop())
    return supervisor.run()


class Child:
    """One supervised process: how to start it, the process, its restarts."""

    def __init__(self, name: str, argv: list[str], log_path: Path):
        self.name, self.argv, self.log_path = name, argv, log_path
        self.process: subprocess.Popen | None = None
        self.restarts = 0
        self.next_start_s = 0.0

    def start(self) -> None:
        log = open(self.log_path, "ab")
        # its own process group: a Ctrl-C in up's terminal reaches up alone, which stops the children in order
        self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True)
        log.close()

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            self.process.send_signal(sig)


class Supervisor:
    def __init__(self, deployment: Deployment, *, use_router: bool = True, log=None):
        self.deployment = deployment
        self.settings = deployment.supervisor
        self.log = log or (lambda msg: print(f"deltaserve up: {msg}", file=sys.stderr, flush=True))
        self.log_dir = Path(self.settings.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.instances = {i.name: Child(i.name, _serve_argv(i), self.log_dir / f"{i.name}.log")
                          for i in deployment.instances}
        self.specs = {i.name: i for i in deployment.instances}
        self.router = deployment.router if use_router else None
        self.router_child = self.front_child = None
        if self.router:
            self.router_url = f"http://{self.router.host}:{_free_port(self.router.host)}"  # the front door's upstream
            self.router_child = Child("router", _router_argv(self.router, self.router_url),
                                      self.log_dir / "router.log")
            self.front_child = Child("front", _front_argv(self.router, self.router_url),
                                     self.log_dir / "front.log")
        self._stop = threading.Event()
        self._restarts_metric = self._ready_metric = None
        if self.settings.metrics_port is not None:
            from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

            registry = CollectorRegistry()
            self._restarts_metric = Counter("deltaserve_deploy_restarts", "instance restarts by the supervisor",
                                            ["instance"], registry=registry)
            self._ready_metric = Gauge("deltaserve_deploy_instance_ready", "1 while the supervisor has seen the "
                                       "instance ready (GET /health 200) and not exited since", ["instance"],
                                       registry=registry)
            for name in self.instances:
                self._restarts_metric.labels(name)
                self._ready_metric.labels(name).set(0)
            start_http_server(self.settings.metrics_port, addr="127.0.0.1", registry=registry)

    def request_stop(self) -> None:
        self._stop.set()

    def run(self) -> int:
        """Start, supervise until asked to stop, stop; 0 after a clean stop, 2 when an instance never became ready."""
        try:
            for child in self.instances.values():
                self.log(f"starting {child.name} on {self.specs[child.name].url} (log {child.log_path})")
                child.start()
            for name, child in self.instances.items():
                if not self._wait_ready(child, self.specs[name].url):
                    if self._stop.is_set():
                        return 0
                    raise DeployError(f"instance {name} did not become ready: see {child.log_path}")
                self._set_ready(name, True)
            if self.router_child is not None:
                self._start_router()
            self.log("ready: " + ", ".join(f"{i.role} -> {i.url}" for i in self.deployment.instances)
                     + (f"; clients use {self.router.url}/v1" if self.router else ""))
            self._supervise()
            return 0
        finally:
            self._stop_all()

    def _supervise(self) -> None:
        while not self._stop.wait(POLL_S):
            for name, child in self.instances.items():
                if child.alive or self._stop.is_set():
                    continue
                now = time.monotonic()
                if child.next_start_s == 0.0:
                    code = child.process.returncode if child.process else None
                    backoff = min(self.settings.max_restart_backoff_s, 2.0 ** child.restarts)
                    child.restarts += 1
                    child.next_start_s = now + backoff
                    self._set_ready(name, False)  # before the count: whoever sees the restart sees it not ready
                    if self._restarts_metric is not None:
                        self._restarts_metric.labels(name).inc()
                    self.log(f"{name} exited (code {code}); restart {child.restarts} in {backoff:.0f} s")
                elif now >= child.next_start_s:
                    child.next_start_s = 0.0
                    child.start()
                    threading.Thread(target=self._register_when_ready, args=(child,), daemon=True).start()
            if self.router_child is not None and not self.router_child.alive and not self._stop.is_set():
                self.router_child.restarts += 1
                self.log(f"router exited (code {self.router_child.process.returncode}); starting it again")
                self._start_router()
            if self.front_child is not None and not self.front_child.alive and not self._stop.is_set():
                self.front_child.restarts += 1
                self.log(f"front door exited (code {self.front_child.process.returncode}); starting it again")
                self._start_front()

    def _register_when_ready(self, child: Child) -> None:
        if self._wait_ready(child, self.specs[child.name].url):
            self.log(f"{child.name} is back (restart {child.restarts})")
            self._set_ready(child.name, True)
            if self.router_child is not None:
                self._register(self.specs[child.name])

    def _set_ready(self, name: str, ready: bool) -> None:
        if self._ready_metric is not None:
            self._ready_metric.labels(name).set(1 if ready else 0)

    def _wait_ready(self, child: Child, url: str) -> bool:
        deadline = time.monotonic() + self.settings.ready_timeout_s
        while time.monotonic() < deadline and not self._stop.is_set():
            if not child.alive:
                return False
            try:
                if HTTP.get(f"{url}/health", timeout=2.0).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            self._stop.wait(POLL_S)
        return False

    def _start_router(self) -> None:
        self._start_answering(self.router_child, self.router_url, "the router")
        for instance in self.deployment.instances:
            self._register(instance)
        if not self.front_child.alive:
            self._start_front()

    def _start_front(self) -> None:
        self._start_answering(self.front_child, self.router.url, "the front door")

    def _start_answering(self, child: Child, url: str, what: str) -> None:
        """Start `child` and wait until `url`/health answers (anything below 500)."""
        child.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and child.alive:
            try:
                if HTTP.get(f"{url}/health", timeout=2.0).status_code < 500:
                    return
            except httpx.HTTPError:
                time.sleep(POLL_S)
        raise DeployError(f"{what} did not start: see {child.log_path}")

    def _register(self, instance: Instance) -> None:
        """Tell the router about an instance; it reads the instance's /server_info for its model name."""
        try:
            response = HTTP.post(f"{self.router_url}/workers", timeout=30.0,
                                  json={"url": instance.url, "model_id": instance.role})
            if response.status_code >= 400 and "already" not in response.text:
                self.log(f"router refused {instance.name}: {response.status_code} {response.text[:200]}")
        except httpx.HTTPError as e:
            self.log(f"could not register {instance.name} with the router: {e}")

    def _stop_all(self) -> None:
        """Router first (no new requests reach the instances), then SIGTERM every instance (each drains within its
    --shutdown-timeout, `shutdown_timeout_s` in the deploy file) and wait for it."""
        for child in (self.front_child, self.router_child):
            if child is not None:
                child.signal(signal.SIGTERM)
        for child in self.instances.values():
            child.signal(signal.SIGTERM)
        drain_s = max(i.config.shutdown_timeout_s for i in self.deployment.instances)
        deadline = time.monotonic() + drain_s + STOP_GRACE_S
        children = [*self.instances.values(), *(c for c in (self.router_child, self.front_child) if c is not None)]
        for child in children:
            if child.process is None:
                continue
            try:
                child.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.log(f"{child.name} did not stop in time; killing it")
                child.process.kill()
                child.process.wait()
        self.log("stopped")


def _serve_argv(instance: Instance) -> list[str]:
    return [sys.executable, "-m", "deltaserve.cli", "serve", *instance.flags]


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _front_argv(router, upstream: str) -> list[str]:
    return [sys.executable, "-m", "deltaserve.deploy.front", "--host", router.host, "--port", str(router.port),
            "--upstream", upstream]


def _router_argv(router, url: str) -> list[str]:
    argv = [sys.executable, "-m", "vllm_router.launch_router", "--host", router.host, "--port", url.rsplit(":", 1)[1],
            "--enable-igw", "--policy", router.policy, "--log-level", "warning"]
    key = os.environ.get("DELTASERVE_API_KEY")
    if key:
        argv += ["--api-key", key]  # the router passes it to the instances, which require it
    return argv
