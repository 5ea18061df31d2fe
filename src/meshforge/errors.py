"""The exception type of user mistakes, on the ground floor so that every room can raise it."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user mistake (a config value, a flag, a file the user named): the message is one line naming the key, the
    value and the fix, printed without a traceback (exit 2). Anything else raised is a bug and keeps its traceback."""
