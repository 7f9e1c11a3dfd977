"""Errors a user can act on: the entry points print them as one `error: ...` line and exit non-zero."""


class UsageError(Exception):
    """A bad flag, file or environment; the message names the flag or file and the problem."""


class DataError(UsageError):
    """A missing or malformed data file; the message starts with the file name (and line, where there is one)."""


class NonFiniteLossError(UsageError):
    """The loss became NaN or infinite; the run stops before the optimizer step so weights stay finite."""
