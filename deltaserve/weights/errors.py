"""The one error a checkpoint reader raises."""

from pathlib import Path


class CheckpointError(Exception):
    """A checkpoint that cannot be read: `str(e)` is one line, `<file>: <problem>`."""

    def __init__(self, path: str | Path, problem: str):
        self.path = Path(path)
        # One line: nested library messages often carry newlines.
        self.problem = " ".join(str(problem).split())
        super().__init__(f"{self.path}: {self.problem}")
