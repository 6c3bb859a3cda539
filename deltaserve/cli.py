"""`deltaserve serve | generate | plan | stress | up`: one entry point, each command's code lives with its owner."""

from __future__ import annotations

import argparse
import sys


class UsageError(Exception):
    """A bad argument or input: one line on stderr, exit code 2."""


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    p.add_argument("prompt", help="the prompt text (with --chat: the user message)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens to generate at most [128]")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy [0]")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: draw from the smallest set of "
                   "tokens whose probabilities reach this fraction (1 = off) [1.0]")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    from deltaserve.config import add_engine_arguments

    add_engine_arguments(p)
    p.set_defaults(run=_run_generate)


def _run_generate(args) -> int:
    from deltaserve.config import EngineConfig
    from deltaserve.engine.engine import Engine, RequestRefused
    from deltaserve.engine.request import SamplingParams

    config = EngineConfig.from_args(args)
    engine = Engine(config, log=lambda msg: print(msg, file=sys.stderr))
    tok = engine.tokenizer
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        prompt_ids = tok.encode_chat(messages, add_generation_prompt=True)
    else:
        prompt_ids = tok.encode(args.prompt)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    engine.start()
    try:
        stream = engine.submit(prompt_ids, params)
        for out in stream:
            sys.stdout.write(out.text)
            sys.stdout.flush()
            if out.finished and out.finish_reason == "error":
                raise UsageError(f"generation failed: {out.error}")
    except RequestRefused as e:
        raise UsageError(e.message) from None
    finally:
        engine.shutdown()
    sys.stdout.write("\n")
    return 0


def _add_delegated(sub, name: str, module: str, help_text: str) -> None:
    """A command whose arguments and body live in `module` (add_arguments(parser), run(args) -> int)."""
    import importlib

    mod = importlib.import_module(module)
    p = sub.add_parser(name, help=help_text)
    mod.add_arguments(p)
    p.set_defaults(run=mod.run)


def _add_plan(sub) -> None:
    """`deltaserve plan`: one model's ledger (plan.py), or with a deploy file every instance's side by side
    (deploy/plan.py); the two never import each other, both use budget/."""
    _add_delegated(sub, "plan", "deltaserve.plan", "print the memory ledger for a model and settings")
    p = sub.choices["plan"]
    p.add_argument("deploy_file", nargs="?", help="a deploy.toml: plan every instance side by side instead")
    p.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    if args.deploy_file:
        from deltaserve.deploy.plan import run_file

        return run_file(args.deploy_file)
    from deltaserve.plan import run

    return run(args)


def _expected_errors() -> tuple[type[Exception], ...]:
    """The errors that mean bad input or settings, not a bug: reported in one line, no traceback."""
    from deltaserve.budget import BudgetError, SpecError
    from deltaserve.config import ConfigError
    from deltaserve.models import UnsupportedModelError
    from deltaserve.weights import CheckpointError

    return (UsageError, CheckpointError, ConfigError, BudgetError, UnsupportedModelError, SpecError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltaserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_delegated(sub, "serve", "deltaserve.server.serve", "run the OpenAI-compatible HTTP server")
    _add_generate(sub)
    _add_plan(sub)
    _add_delegated(sub, "stress", "deltaserve.stress.cli", "load-test an OpenAI-compatible server")
    _add_delegated(sub, "up", "deltaserve.deploy.up", "start a deployment (deploy.toml): instances and router")
    return parser


def _show_progress() -> None:
    """Our loggers' INFO lines (a checkpoint's load progress, weights/progress.py) on stderr, once per process."""
    import logging

    class Stderr(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            print(self.format(record), file=sys.stderr, flush=True)  # the sys.stderr of the moment

    logger = logging.getLogger("deltaserve")
    if not logger.handlers:
        logger.addHandler(Stderr())
        logger.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    """Parse, run, and turn every expected failure into one line on stderr with exit code 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _show_progress()
    try:
        return int(args.run(args) or 0)
    except _expected_errors() as e:
        print(f"deltaserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
