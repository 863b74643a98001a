"""SIGINT, SIGTERM and SIGHUP during a reply on the command line: stop it, store what was shown, exit as
shells expect.

Python's default (KeyboardInterrupt raised wherever the program happens to be; SIGTERM and SIGHUP
killing it outright) loses the reply the user already read. Here the first signal only sets the
reply's cancel event: generation stops before its next token, or a long prompt between two prefill
batches, and the reply is stored as usual. A second signal raises KeyboardInterrupt: it gives up
waiting (for the database lock, for the KV snapshot), never the reply once it is stored.
"""

from __future__ import annotations

import signal
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class ReplySignals:
    """A context manager: while inside, STOP_SIGNALS cancel the reply instead of killing the process."""

    def __init__(self) -> None:
        self.cancel = threading.Event()
        self.received: signal.Signals | None = None  # the first one
        self.count = 0

    def __enter__(self) -> ReplySignals:
        self._previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _on_signal(self, signum: int, frame) -> None:
        self.count += 1
        if self.received is None:
            self.received = signal.Signals(signum)
            self.cancel.set()
            return
        raise KeyboardInterrupt

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, as a shell reports a process the signal ended (130 for Ctrl+C)."""
        return 0 if self.received is None else 128 + self.received

    def stop_reason(self, reason: str) -> str:
        """The reply's stop reason, saying which signal cancelled it."""
        return f"{reason or 'cancelled'} by {self.received.name}" if self.received else reason
