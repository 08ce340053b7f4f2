"""The one exception type for mistakes a user can fix (a bad spec, a missing file, bad credentials).

The CLI prints its message, without a traceback, and exits non-zero. A leaf module: every kiln package
may import it.
"""


class KilnError(Exception):
    """A user-facing error; the message names the cause and, where it can, what would be valid."""

    exit_code = 1
