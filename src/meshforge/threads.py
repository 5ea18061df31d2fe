"""Background work that never fails silently and is never waited on without a bound.

`Worker` is a daemon thread that records the exception that ends it (so no thread dies with "Exception in thread"
on stderr while the main path carries on); `Worker.check` and `Worker.finish` re-raise it to whoever waits, as one
line naming the worker (`errors.BackgroundError`; a `ConfigError` as it is). `result` does the same for a future of an
executor. Every thread of the project is one of these, or records its failure itself (data/integrity.py
`ShardChecker`), and tests/unit/test_background.py makes each one raise.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

from meshforge.errors import BackgroundError, ConfigError


def reraise(what: str, error: BaseException) -> None:
    """Raise a worker's failure in the waiting thread: a ConfigError as it is (one line already), anything else as a
    one-line `BackgroundError` naming the worker, with the worker's exception chained."""
    if isinstance(error, ConfigError):
        raise error
    raise BackgroundError.of(what, error) from error


class Worker(threading.Thread):
    """A daemon thread running ``target`` that keeps its failure for `check` / `finish` instead of dying unseen."""

    def __init__(self, target: Callable[[], None], *, name: str, what: str) -> None:
        super().__init__(name=name, daemon=True)
        self.work, self.what = target, what
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            self.work()
        except BaseException as error:  # kept for whoever waits: never an unhandled thread exception
            self.failure = error

    def check(self) -> None:
        """Re-raise the worker's failure, if any, as one line (see `reraise`)."""
        if self.failure is not None:
            reraise(self.what, self.failure)

    def finish(self, timeout: float) -> None:
        """Wait at most ``timeout`` seconds for the worker to end; one line when it is still running or failed."""
        if self.ident is not None:
            self.join(timeout)
        if self.is_alive():
            raise BackgroundError(f"{self.what} did not stop within {timeout:g} s (thread {self.name})")
        self.check()


def result(future: concurrent.futures.Future[Any], what: str, timeout: float | None = None) -> Any:
    """The future's result; its failure re-raised as one line naming ``what`` (see `reraise`), and, with a timeout,
    a one-line `BackgroundError` when it has not finished within it."""
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        raise BackgroundError(f"{what} did not finish within {timeout:g} s") from None
    except concurrent.futures.CancelledError:
        raise BackgroundError(f"{what} was cancelled") from None
    except Exception as error:
        reraise(what, error)
        raise  # unreachable: reraise always raises
