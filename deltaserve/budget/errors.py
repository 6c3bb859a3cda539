"""The two ways a plan fails: the model cannot be described, or its ledger does not fit."""

class BudgetError(RuntimeError):
    """The ledger does not fit; the message names the shortfall in MiB and two concrete fixes."""


class SpecError(ValueError):
    """The model cannot be described: unsupported type, missing field, unreadable header."""
