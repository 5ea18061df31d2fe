"""The exception type of user mistakes, on the ground floor so that every room can raise it."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A user mistake (a config value, a flag, a file the user named): the message is one line naming the key, the
    value and the fix, printed without a traceback (exit 2). Anything else raised is a bug and keeps its traceback."""


def require_positive(key: str, value: int) -> None:
    """ConfigError ``"<key> = <value> must be >= 1"`` for a count below 1."""
    if value < 1:
        raise ConfigError(f"{key} = {value} must be >= 1")


def optional_import(module: str, feature: str, install: str) -> Any:
    """Import an optional package where it is used: its absence is a `ConfigError` of one line naming the feature
    that needs it and the command that installs it (stock PyTorch containers lack e.g. ``tomli_w``, ``torchao``)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:  # also the `sys.modules[name] = None` of a test that hides the package
        raise ConfigError(f"{feature} needs the optional package {module.split('.')[0]}: {install}") from None


class BackgroundError(RuntimeError):
    """A worker off the main path (a reader thread, the checkpoint writer, a sampler, a watchdog) failed or did not
    finish within its bound: one line naming the worker and what happened, raised to whoever waits on it (the worker's
    own exception chained, so its traceback is kept for the bug report)."""

    @classmethod
    def of(cls, what: str, error: BaseException) -> BackgroundError:
        """``"<what> failed: <type>: <first line of the error>"``."""
        text = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return cls(f"{what} failed: {type(error).__name__}{': ' + text if text else ''}")
