"""`deltaserve serve`: bind the port, start uvicorn at once, and load the engine behind it (/health 503 till then).

SIGTERM or Ctrl-C drains (server/drain.py: 503 to new requests, running ones finish within --shutdown-timeout, the
rest end with an error event) before uvicorn stops; then the process exits 0. A second signal cuts at once, a
third quits without waiting.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
from types import FrameType
from pathlib import Path

import uvicorn

from deltaserve.config import ConfigError, EngineConfig, add_engine_arguments
from deltaserve.server.app import create_app
from deltaserve.server.connections import protocol_class
from deltaserve.server.drain import Drain

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
GRACEFUL_SHUTDOWN_S = 5  # after the drain: uvicorn's own wait for connections still open (a client reading slowly)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's settings plus the server's own (log level)."""
    add_engine_arguments(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="uvicorn log level (info)")
    g.add_argument("--no-access-log", action="store_true", help="do not log one line per HTTP request")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or a ConfigError naming the address (in use, not local, ...)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        raise ConfigError(f"--host {host} --port {port}: cannot listen there: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose SIGTERM / SIGINT start the drain instead of closing the socket at once.

    uvicorn re-raises a captured signal after its shutdown (the process then dies by it, exit code -15); a drained
    server has ended every request in words and exits 0 instead, so the signal is not recorded."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain
        self.signals = 0
        self._drain_task: asyncio.Task | None = None
        self._hurried = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: only flags here, the event loop acts on them at its next tick (every 0.1 s).
        self.signals += 1
        if self.signals >= 3:
            self.force_exit = self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.signals and self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain_then_exit())
        if self.signals == 2 and not self._hurried:
            self._hurried = True
            self.drain.hurry()
        return await super().on_tick(counter)

    async def _drain_then_exit(self) -> None:
        await self.drain.run()
        self.should_exit = True


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; a model that fails to load stops the server and its error is raised here."""
    config = EngineConfig.from_args(args)
    if config.model is not None and not Path(config.model).exists():
        raise ConfigError(f"--model {config.model}: no such file or folder")  # before the port, not after loading
    sock = bind(config.host, config.port)
    host, port = sock.getsockname()[:2]
    load_errors: list[BaseException] = []
    server: DrainingServer | None = None

    def stop(error: BaseException) -> None:
        load_errors.append(error)
        server.should_exit = True

    app = create_app(config, on_load_failure=stop, freeze_after_load=True)
    http = protocol_class(config.header_timeout_s, config.max_connections)
    server = DrainingServer(uvicorn.Config(app, http=http, log_level=args.log_level, access_log=not args.no_access_log,
                                           timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S), app.state.server.drain)
    print(f"deltaserve: listening on http://{host}:{port} (GET /health answers 503 until the model has loaded)",
          file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    if load_errors:
        raise load_errors[0]
    return 0


def _expected_errors() -> tuple[type[Exception], ...]:
    """Bad settings or a bad checkpoint: one line on stderr, exit code 2 (as the `deltaserve` CLI does)."""
    from deltaserve.budget import BudgetError, SpecError
    from deltaserve.models import UnsupportedModelError
    from deltaserve.weights import CheckpointError

    return ConfigError, BudgetError, UnsupportedModelError, CheckpointError, SpecError


def main(argv: list[str] | None = None) -> int:
    """`python -m deltaserve.server.serve ...`, the same as `deltaserve serve ...`."""
    parser = argparse.ArgumentParser(prog="deltaserve serve", description="the OpenAI-compatible HTTP server")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except _expected_errors() as e:
        print(f"deltaserve serve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
