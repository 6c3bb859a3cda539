"""docs/configuration.md, generated from the argument parsers: every flag's meaning, default and unit.

    python -m deltaserve.cli_docs            # rewrite docs/configuration.md
    python -m deltaserve.cli_docs --check    # exit 1 when the file is stale

The meaning is the flag's own help text; the default is read from the parser, or for engine settings (whose parser
defaults stay None) from EngineConfig and its `for_device` fill-in, so a default changed in config.py changes here;
the unit comes from UNITS below (a flag without one stops the generator: say what its number counts).
tests/test_docs.py fails when the file is stale.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from deltaserve.config import SIZE_FLAGS, EngineConfig

OUTPUT = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
SHARED_GROUPS = ("engine", "access")  # add_engine_arguments: the same in serve, generate and plan
SIZE = "size in bytes (`24GiB`, `512MiB`, `1.5GB`, `4096`)"
SIZE_DESTS = set(SIZE_FLAGS) | {"host_tier"}

# What each option's value is, by its dest (choices and switches describe themselves).
UNITS = {
    "model": "path: folder, `.gguf` or `config.json`",
    "device": "`auto`, `cpu`, `cuda`, `cuda:N` or a size",
    "dtype": "`auto`, `float32`, `bfloat16`, `float16`",
    "page_size": "tokens",
    "mem_fraction": "fraction in (0, 1]",
    "max_total_tokens": "tokens",
    "context_length": "tokens",
    "max_running_requests": "requests",
    "prefill_chunk_tokens": "tokens",
    "kv_dtype": "`auto`, `float32`, `bfloat16`, `float16`, `fp8`",
    "state_dtype": "`auto`, `float32`, `bfloat16`, `float16`",
    "max_new_tokens_cap": "tokens",
    "default_max_tokens": "tokens",
    "max_queue": "requests",
    "host": "address",
    "port": "port number",
    "served_model_name": "name",
    "seed": "integer",
    "attention_backend": "`auto`, `paged`, `portable`",
    "prefill_dtype": "`float32`, `bfloat16`",
    "activation_dtype": "`float32`, `int8`",
    "tool_call_parser": "parser name",
    "reasoning_parser": "parser name",
    "chat_template": "path to a jinja file",
    "max_images_per_request": "images",
    "max_image_pixels": "pixels",
    "allowed_local_media_path": "folder",
    "checkpoint_slots": "checkpoints",
    "checkpoint_interval_tokens": "tokens",
    "speculative_tokens": "draft tokens per request per step",
    "api_key": "text",
    "api_key_file": "path",
    "allowed_hosts": "comma-separated host names",
    "allowed_origins": "comma-separated origins",
    "header_timeout_s": "seconds",
    "max_connections": "connections",
    "shutdown_timeout_s": "seconds",
    # generate
    "prompt": "text",
    "max_tokens": "tokens",
    "temperature": "number >= 0",
    "top_p": "fraction in (0, 1]",
    "system": "text",
    # plan
    "deploy_file": "path to a deploy.toml",
    "quant": "scheme, e.g. `w4a16-g128`",
    "embed_quant": "scheme: `int8`, `int4`, `none`",
    "lm_head_quant": "scheme: `int8`, `int4`, `none`",
    "request_context": "tokens",
    "chart": "path of a PNG to write",
    # stress
    "url": "URL",
    "concurrency": "comma-separated counts",
    "prompt_tokens": "comma-separated token counts (`14k` allowed)",
    "gen_tokens": "comma-separated token counts",
    "scale": "factor",
    "rounds": "rounds",
    "duration_limit": "seconds",
    "recover_wait": "seconds",
    "probe_interval": "seconds",
    "tokenizer": "path: folder or `.gguf`",
    "out": "folder",
}


# Where one command's option shares a dest with another's but not its meaning.
COMMAND_UNITS = {("stress", "model"): "model name", ("stress", "api_key"): "text"}


class MissingUnit(KeyError):
    """An option whose value has no unit in UNITS: the reference would not say what its number counts."""


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _summaries(parser: argparse.ArgumentParser) -> dict[str, str]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {choice.dest: choice.help or "" for choice in action._choices_actions}


def _switch(action: argparse.Action) -> bool:
    return action.nargs == 0


def _unit(action: argparse.Action, command: str) -> str:
    if (command, action.dest) in COMMAND_UNITS:
        return COMMAND_UNITS[command, action.dest]
    if _switch(action):
        return "switch"
    if action.choices:
        return ", ".join(f"`{c}`" for c in action.choices)
    if action.dest in SIZE_DESTS:
        return SIZE
    if action.dest not in UNITS:
        raise MissingUnit(f"{'/'.join(action.option_strings) or action.dest}: add its unit to "
                          f"deltaserve/cli_docs.py's UNITS")
    return UNITS[action.dest]


def _format(value, dest: str) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if dest in SIZE_DESTS and isinstance(value, int):
        for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
            if value and value % size == 0:
                return f"{value // size} {unit}"
        return str(value)
    if isinstance(value, tuple):
        return ", ".join(value) if value else "none"
    return str(value)


def _engine_default(dest: str) -> str | None:
    """An EngineConfig field's default, with what `for_device` makes of it on CPU and CUDA where that differs."""
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    if dest not in fields or dest in ("device", "api_key"):
        return None
    base = EngineConfig()
    values = [getattr(c, dest) for c in (base, base.for_device("cpu"), base.for_device("cuda"))]
    given, cpu, cuda = (_format(v, dest) for v in values)
    if cpu == cuda:
        return given if given == cpu else f"{given} (= {cpu})"
    return f"CPU {cpu}, CUDA {cuda}"


def _default(action: argparse.Action, shared: bool) -> str:
    if not action.option_strings and action.nargs is None:
        return "required"
    if isinstance(action, argparse._StoreFalseAction):
        return "off"  # the flag turns something off that is on without it
    if shared:
        found = _engine_default(action.dest)
        if found is not None:
            return "off" if _switch(action) and found.rstrip(")").endswith(("off", "none")) else found
        if action.dest == "device":
            return "auto"
    if action.default is None or action.default is argparse.SUPPRESS:
        return "off" if _switch(action) else "none"
    return _format(action.default, action.dest)


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" in text:
        params = {**vars(action), "prog": prog}
        params = {k: (v.__name__ if hasattr(v, "__name__") else v) for k, v in params.items()}
        text = text % params
    return " ".join(text.split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _name(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.dest.upper()}`" + (" (optional)" if action.nargs == "?" else "")
    return " ".join(f"`{s}`" for s in action.option_strings)


def _table(actions: list[argparse.Action], command: str, shared: bool, deploy_keys: bool = False) -> list[str]:
    prog = f"deltaserve {command}"
    head = ["flag", *(["deploy.toml key"] if deploy_keys else []), "value", "default", "meaning"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for action in actions:
        if isinstance(action, argparse._HelpAction):
            continue
        key = [f"`{action.dest}`"] if deploy_keys else []
        row = [_name(action), *key, _unit(action, command), _default(action, shared), _help(action, prog)]
        lines.append("| " + " | ".join(_cell(c) if i != 0 else c for i, c in enumerate(row)) + " |")
    return lines


def _groups(parser: argparse.ArgumentParser) -> list[argparse._ArgumentGroup]:
    return [g for g in parser._action_groups if any(not isinstance(a, argparse._HelpAction)
                                                       for a in g._group_actions)]


def render() -> str:
    """The whole of docs/configuration.md."""
    from deltaserve.cli import build_parser

    parser = build_parser()
    commands = _subparsers(parser)
    summaries = _summaries(parser)
    serve = commands["serve"]
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m deltaserve.cli_docs` from the argument parsers; do not edit by hand. "
        "tests/test_docs.py fails when it is stale. -->",
        "",
        "Every flag of every `deltaserve` command: what its value is, its default, and what it does. The engine and",
        "access settings are shared by `serve`, `generate` and `plan`; in a deploy file each instance takes the same",
        "settings as keys in snake_case (the deploy.toml key column; a switch is `true` / `false`). Where a default",
        "depends on the device it is given for CPU and CUDA; `none` means the meaning column says what happens.",
        "",
        "Sizes take a unit: `KB`, `MB`, `GB` are decimal (1000), `K`, `M`, `G` and `KiB`, `MiB`, `GiB` binary "
        "(1024);",
        "a bare number is bytes. The API key can also come from the environment: `DELTASERVE_API_KEY`.",
        "",
        "Commands: " + ", ".join(f"[`{name}`](#deltaserve-{name})" for name in commands) + ".",
        "",
    ]
    for group in _groups(serve):
        if group.title in SHARED_GROUPS:
            out += [f"## Shared settings: {group.title}", ""]
            out += _table(group._group_actions, "serve", shared=True, deploy_keys=True)
            out.append("")
    for name, sub in commands.items():
        summary = summaries.get(name, "")
        out += [f"## deltaserve {name}", "", f"{summary[:1].upper()}{summary[1:]}.", "", "```",
                f"deltaserve {name} --help", "```", ""]
        own = [g for g in _groups(sub) if g.title not in SHARED_GROUPS]
        if any(g.title in SHARED_GROUPS for g in _groups(sub)):
            out += ["Takes the shared [engine](#shared-settings-engine) and [access](#shared-settings-access) "
                    "settings, and:", ""]
        actions = [a for g in own for a in g._group_actions if not isinstance(a, argparse._HelpAction)]
        if actions:
            out += _table(actions, name, shared=False)
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deltaserve.cli_docs", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/configuration.md is stale")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        if current != text:
            print(f"{OUTPUT} is stale: run python -m deltaserve.cli_docs", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
