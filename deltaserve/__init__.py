"""deltaserve: every byte budgeted before it is allocated."""

__version__ = "0.1.0"
