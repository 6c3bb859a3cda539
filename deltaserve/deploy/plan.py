"""`deltaserve plan deploy.toml`: every instance's ledger side by side, and no device promised twice."""

from __future__ import annotations

import sys
from collections import defaultdict

from deltaserve.budget import Budget, BudgetError, SpecError, load_spec, plan_budget
from deltaserve.config import ConfigError, GiB, device_memory_bytes
from deltaserve.deploy.schema import Deployment, DeployError, Instance, load_deployment


def run_file(path: str) -> int:
    """`deltaserve plan deploy.toml`: print the ledgers; 0, or 2 with one line on stderr for a file that cannot
    run as written."""
    try:
        deployment = load_deployment(path)
        print(report(deployment, plan_deployment(deployment)))
    except (ConfigError, SpecError, BudgetError) as e:
        print(f"deltaserve plan: {e}", file=sys.stderr)
        return 2
    return 0


def device_of(instance: Instance) -> str:
    """The device an instance runs on, as one name per physical device ('cuda' is 'cuda:0')."""
    kind = instance.config.device_kind()
    device = instance.config.device
    if kind == "cuda":
        return device if ":" in device else "cuda:0"
    return "cpu"


def plan_deployment(deployment: Deployment) -> dict[str, Budget]:
    """Instance name -> its ledger; DeployError when the instances on one device need more than it has."""
    budgets: dict[str, Budget] = {}
    for instance in deployment.instances:
        c = instance.config
        kind = c.device_kind()
        try:
            total = c.device_memory or device_memory_bytes(kind)[0]
            budgets[instance.name] = plan_budget(load_spec(c.model), c, device_total_bytes=total, device_kind=kind)
        except ConfigError as e:
            hint = " (to plan for a GPU this machine lacks, give device_memory = \"24GiB\")" if kind == "cuda" else ""
            raise DeployError(f"{deployment.path}: instances.{instance.name}: {e}{hint}") from None
    by_device: dict[str, list[Instance]] = defaultdict(list)
    for instance in deployment.instances:
        by_device[device_of(instance)].append(instance)
    for device, instances in by_device.items():
        need = sum(budgets[i.name].required_bytes for i in instances)
        total = max(budgets[i.name].device_total_bytes for i in instances)
        if len(instances) > 1 and need > total:
            parts = " + ".join(f"{i.name} {budgets[i.name].required_bytes / GiB:.2f}" for i in instances)
            raise DeployError(f"{deployment.path}: device {device} is overcommitted: its instances need {parts} = "
                              f"{need / GiB:.2f} GiB of its {total / GiB:.2f} GiB; lower mem_fraction or give "
                              f"max_total_tokens")
    return budgets


def report(deployment: Deployment, budgets: dict[str, Budget]) -> str:
    """The instances as columns: role, device, port, every ledger line, the pool, the context and the caps."""
    names = [i.name for i in deployment.instances]
    width = max(14, *(len(n) + 2 for n in names))
    rows: list[tuple[str, list[str]]] = [
        ("role (model name)", [i.role for i in deployment.instances]),
        ("device", [device_of(i) for i in deployment.instances]),
        ("port", [str(i.config.port) for i in deployment.instances]),
    ]
    line_names = [line.name for line in next(iter(budgets.values())).lines]
    for line in line_names:
        rows.append((f"{line} (GiB)", [f"{_line_bytes(budgets[n], line) / GiB:.2f}" for n in names]))
    rows += [
        ("KV pool (tokens)", [f"{budgets[n].kv_tokens:,}" for n in names]),
        ("context (tokens)", [f"{budgets[n].max_context_tokens:,}" for n in names]),
        ("output cap", [f"{budgets[n].max_new_tokens_cap:,}" for n in names]),
        ("state slots", [str(budgets[n].state_slots) for n in names]),
        ("device total (GiB)", [f"{budgets[n].device_total_bytes / GiB:.2f}" for n in names]),
    ]
    label_width = max(len(label) for label, _ in rows) + 2
    out = [f"deployment {deployment.path}: {len(names)} instances"]
    out.append(" " * label_width + "".join(f"{n:>{width}}" for n in names))
    out += [f"{label:<{label_width}}" + "".join(f"{v:>{width}}" for v in values) for label, values in rows]
    if deployment.router is not None:
        roles = sorted({i.role for i in deployment.instances})
        out.append(f"router: vllm-router on {deployment.router.url} ({deployment.router.policy}), "
                   f"model names {', '.join(roles)}")
    return "\n".join(out)


def _line_bytes(budget: Budget, name: str) -> int:
    try:
        return budget.line(name).bytes
    except KeyError:
        return 0
