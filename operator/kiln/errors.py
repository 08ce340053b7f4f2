"""The one exception type for mistakes a user can fix (a bad spec, a missing file, bad credentials).

The CLI prints its message, without a traceback, and exits non-zero. A leaf module: every kiln package
may import it.
"""


class KilnError(Exception):
    """A user-facing error; the message names the cause and, where it can, what would be valid."""

    exit_code = 1
    retryable = False  # whether running the same command again can succeed (the CLI advises a rerun only then)


class Unavailable(KilnError):
    """Something outside kiln that may come back (an object store that stopped answering): a rerun can help."""

    retryable = True
