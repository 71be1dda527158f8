"""The one exception type that reaches users as a single line (exit code 2, no traceback)."""


class PPOLMError(Exception):
    """A problem with the user's input or environment, stated in one line with the fix.

    The CLI prints ``error: <message>`` to stderr and exits with code 2.
    """


FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32: learning rates above it overflow inside the optimiser, so configs reject them."""
