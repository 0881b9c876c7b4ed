"""User-facing errors.

A `CohortError` is a problem with the user's input (a path, a config value, a data file).
The CLI prints its message as one line and exits non-zero without a traceback; the
message must name the offending input and say how to fix it.
"""


class CohortError(Exception):
    """Bad input: printed as one line by the CLI, never with a traceback (unless --debug)."""
