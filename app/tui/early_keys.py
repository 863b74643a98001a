"""Keys typed while the app starts, read as they were meant: Enter sends.

Until the app's terminal driver starts, the terminal is in its ordinary (cooked) mode, in which the
kernel turns each Enter (a carriage return) into a line feed as it arrives (ICRNL). Textual reads a
line feed as Ctrl+J, which adds a line in the message box: "hello⏎" typed in the first second of a
start landed as "hello\\n", not sent. So just before Textual's driver starts reading, the terminal goes
into its raw mode here and what it already holds is read: a line feed there was an Enter (Ctrl+J, the
same byte, is no key anyone presses before the screen is up), and reaches the app as one, ahead of
everything typed later.
"""

from __future__ import annotations

import os
import termios
import tty

from textual import events
from textual._xterm_parser import XTermParser  # the parser Textual's own driver reads keys with
from textual.drivers.linux_driver import LinuxDriver


def typed_keys(fd: int) -> list[events.Event]:
    """Put the terminal `fd` in the driver's raw mode and read what was typed before: its keys, a line
    feed an Enter."""
    attrs = termios.tcgetattr(fd)
    attrs[tty.LFLAG] = LinuxDriver._patch_lflag(attrs[tty.LFLAG])
    attrs[tty.IFLAG] = LinuxDriver._patch_iflag(attrs[tty.IFLAG])
    attrs[tty.CC][termios.VMIN], attrs[tty.CC][termios.VTIME] = 0, 0  # read what is there, wait for none
    termios.tcsetattr(fd, termios.TCSANOW, attrs)
    typed = b""
    while chunk := os.read(fd, 4096):
        typed += chunk
    parser = XTermParser()
    text = typed.decode("utf-8", errors="replace").replace("\n", "\r")
    return [*parser.feed(text), *parser.feed("")] if text else []


class EarlyKeysDriver(LinuxDriver):
    """Textual's driver for Linux and macOS terminals, which first hands the app the keys typed before
    it started (typed_keys)."""

    def start_application_mode(self) -> None:
        try:
            before = termios.tcgetattr(self.fileno)
            typed = typed_keys(self.fileno)
        except termios.error:  # not a terminal (a pipe): nothing typed
            return super().start_application_mode()
        for event in typed:  # posted before the driver's own reading begins
            self.process_message(event)
        super().start_application_mode()
        self.attrs_before = before  # what the terminal goes back to at the end (not our raw mode)
