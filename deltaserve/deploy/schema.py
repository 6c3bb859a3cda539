"""deploy.toml: the instances of one deployment (each an engine with its own role and ledger) and the router in front.

    [router]                      # optional; an existing router (vllm-router) started by `deltaserve up`
    host = "127.0.0.1"
    port = 8080
    policy = "cache_aware"        # how it spreads load over the replicas of one role

    [supervisor]                  # optional
    metrics_port = 8090           # Prometheus: restarts per instance (absent: restarts are only logged)
    log_dir = "deploy-logs"       # one log file per instance and the router

    [instances.chat]              # one table per instance; its keys are `deltaserve serve` flags in snake_case
    device = "cuda:0"
    served_model_name = "chat"    # the role: the model name clients ask for (replicas of a role share it)
    port = 11434
    mem_fraction = 0.91
    max_total_tokens = 133120
    shutdown_timeout_s = 30       # on SIGTERM, running requests finish within this; `up` waits that long, and more

Every instance is checked as `deltaserve serve` would check its flags (the same parser, the same EngineConfig), so a
bad value is refused before anything starts; errors name the file and line.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import tomllib
from pathlib import Path

from deltaserve.config import ConfigError, EngineConfig

ROUTER_KEYS = {"host": str, "port": int, "policy": str}
SUPERVISOR_KEYS = {"metrics_port": int, "log_dir": str, "ready_timeout_s": (int, float),
                   "max_restart_backoff_s": (int, float)}
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "consistent_hash")


class DeployError(ConfigError):
    """A deploy file that cannot run as written: one line naming the file, the line and the problem."""


@dataclasses.dataclass(frozen=True)
class Instance:
    """One engine process: its name (the table's), its settings and the `deltaserve serve` flags that give them."""

    name: str
    config: EngineConfig
    flags: tuple[str, ...]

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    @property
    def role(self) -> str:
        return self.config.served_model_name or self.name


@dataclasses.dataclass(frozen=True)
class Router:
    host: str = "127.0.0.1"
    port: int = 8080
    policy: str = "cache_aware"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclasses.dataclass(frozen=True)
class Supervisor:
    metrics_port: int | None = None
    log_dir: str = "deploy-logs"
    ready_timeout_s: float = 600.0  # the first start compiles the CPU kernels (minutes) and loads the weights
    max_restart_backoff_s: float = 30.0


@dataclasses.dataclass(frozen=True)
class Deployment:
    path: Path
    instances: tuple[Instance, ...]
    router: Router | None
    supervisor: Supervisor


def load_deployment(path: str | Path) -> Deployment:
    """Read and check a deploy file; DeployError (one line: file, line, problem) when it cannot run as written."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise DeployError(f"{path}: cannot read it: {e.strerror or e}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise DeployError(f"{path}: not valid TOML: {e}") from None
    where = _Locator(path, text)
    unknown = set(data) - {"router", "supervisor", "instances"}
    if unknown:
        key = sorted(unknown)[0]
        raise DeployError(f"{where.of(None, key)}: unknown table or key {key!r}: expected [router], [supervisor] "
                          f"and [instances.NAME] tables")
    tables = data.get("instances")
    if not isinstance(tables, dict) or not tables:
        raise DeployError(f"{path}: no instances: add at least one [instances.NAME] table")
    instances = tuple(_instance(name, table, where) for name, table in tables.items())
    router = _section(Router, data["router"], ROUTER_KEYS, "router", where) if "router" in data else None
    if router is not None and router.policy not in ROUTER_POLICIES:
        raise DeployError(f"{where.of('router', 'policy')}: policy {router.policy!r} is not one of "
                          f"{', '.join(ROUTER_POLICIES)}")
    supervisor = _section(Supervisor, data.get("supervisor", {}), SUPERVISOR_KEYS, "supervisor", where)
    _check_ports(instances, router, supervisor, where)
    return Deployment(path, instances, router, supervisor)


def _instance(name: str, table, where: _Locator) -> Instance:
    """The instance's flags, parsed by the same parser and checked by the same EngineConfig as `deltaserve serve`."""
    if not isinstance(table, dict):
        raise DeployError(f"{where.of(None, 'instances')}: instances.{name} must be a table ([instances.{name}])")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise DeployError(f"{where.of('instances.' + name, None)}: instance name {name!r}: use letters, digits, "
                          f"'_', '-' and '.' only (it names the instance's log file)")
    from deltaserve.server.serve import add_arguments  # the flags of `deltaserve serve`, nothing of the server runs

    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    add_arguments(parser)
    known = {action.dest: action for action in parser._actions if action.option_strings}
    flags: list[str] = []
    for key, value in table.items():
        line = where.of(f"instances.{name}", key)
        action = known.get(key)
        if action is None:
            raise DeployError(f"{line}: unknown key {key!r} in instances.{name}: keys are `deltaserve serve` flags "
                              f"in snake_case, e.g. mem_fraction, max_total_tokens, served_model_name, port")
        flag = action.option_strings[0]
        if isinstance(value, bool):
            if not isinstance(action, argparse.BooleanOptionalAction):
                raise DeployError(f"{line}: {key} = {str(value).lower()}: {key} takes a value, not true/false")
            flags.append(flag if value else "--no-" + flag.removeprefix("--"))
        elif isinstance(value, (int, float, str)):
            flags += [flag, str(value)]
        else:
            raise DeployError(f"{line}: {key} must be a number or a string, not {type(value).__name__}")
    try:
        config = EngineConfig.from_args(parser.parse_args(flags))
    except (ConfigError, argparse.ArgumentError) as e:
        raise DeployError(f"{where.of(f'instances.{name}', None)}: instances.{name}: {e}") from None
    if "port" not in table:
        raise DeployError(f"{where.of(f'instances.{name}', None)}: instances.{name} has no port: each instance "
                          f"listens on its own")
    return Instance(name, config, tuple(flags))


def _section(cls, table, keys: dict, name: str, where: _Locator):
    if not isinstance(table, dict):
        raise DeployError(f"{where.of(None, name)}: [{name}] must be a table")
    for key, value in table.items():
        if key not in keys:
            raise DeployError(f"{where.of(name, key)}: unknown key {key!r} in [{name}]: expected "
                              f"{', '.join(keys)}")
        if isinstance(value, bool) or not isinstance(value, keys[key]):
            raise DeployError(f"{where.of(name, key)}: {name}.{key} = {value!r} has the wrong type")
    return cls(**table)


def _check_ports(instances, router: Router | None, supervisor: Supervisor, where: _Locator) -> None:
    """No two listeners of the deployment on one host:port."""
    seen: dict[tuple[str, int], str] = {}
    listeners = [(f"instances.{i.name}", i.config.host, i.config.port) for i in instances]
    if router is not None:
        listeners.append(("router", router.host, router.port))
    if supervisor.metrics_port is not None:
        listeners.append(("supervisor", "127.0.0.1", supervisor.metrics_port))
    for owner, host, port in listeners:
        clash = seen.get((_host_key(host), port))
        if clash is not None:
            raise DeployError(f"{where.of(owner, 'port' if owner != 'supervisor' else 'metrics_port')}: port {port} "
                              f"of {owner} is already {clash}'s: each instance, the router and the metrics need "
                              f"their own port")
        seen[(_host_key(host), port)] = owner


def _host_key(host: str) -> str:
    return "local" if host in ("127.0.0.1", "localhost", "0.0.0.0", "::1", "::") else host


class _Locator:
    """`file:line` of a key in a table, for error messages (tomllib gives values, not positions)."""

    def __init__(self, path: Path, text: str):
        self.path = path
        self.lines = text.splitlines()

    def of(self, table: str | None, key: str | None) -> str:
        current = None
        header_line = None
        for number, raw in enumerate(self.lines, 1):
            line = raw.split("#", 1)[0].strip()
            header = re.fullmatch(r"\[\s*([^\]]+?)\s*\]", line)
            if header:
                current = header.group(1).replace('"', "")
                if current == table:
                    header_line = number
                continue
            if key is not None and current == table and re.match(rf"{re.escape(key)}\s*=", line):
                return f"{self.path}:{number}"
            if key is not None and table is None and current is None and re.match(rf"{re.escape(key)}\s*=", line):
                return f"{self.path}:{number}"
        if key is not None and table is None:
            for number, raw in enumerate(self.lines, 1):
                if re.fullmatch(rf"\[\s*{re.escape(key)}[\].]?.*", raw.strip()):
                    return f"{self.path}:{number}"
        return f"{self.path}:{header_line}" if header_line else str(self.path)
