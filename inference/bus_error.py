"""A file cut short under a process that maps it ends that process with one line and status 2.

Reading a page of a mapped file beyond its end raises SIGBUS, whose default action kills the process
without a word. llama-chat never shortens a file it maps (packed files are written anew and renamed
over the old, which stays whole for whoever maps it), but another program can: `truncate`, an editor,
a copy over the packed weights or the GGUF. A memory fault cannot be handled in Python (its handler
only notes the signal and returns, and the read faults again, for ever), so the handler is a C
function compiled by numba: it writes its line with write(2) and ends the process with _exit(2), both
safe in a signal handler, neither touching Python.
"""

from __future__ import annotations

import ctypes
import functools
import signal

import numpy as np
from numba import cfunc, types

from . import jit  # noqa: F401  (numba set up: its cache folder and this machine's features)

EXIT_STATUS = 2
MESSAGE = np.frombuffer(
    b"llama-chat: a file mapped into memory (a model's GGUF or its packed weights) was cut short by "
    b"another program while in use; stopping\n",
    np.uint8,
)
# Found by name when the compiled code is loaded (a ctypes pointer would be an address of this process,
# which numba's cache cannot keep). The message's address goes as an integer of a pointer's width.
_write = types.ExternalFunction("write", types.intp(types.intc, types.uintp, types.uintp))
_exit = types.ExternalFunction("_exit", types.void(types.intc))


def _on_bus_error(signum):
    _write(2, MESSAGE.ctypes.data, MESSAGE.size)
    _exit(EXIT_STATUS)


@functools.cache
def stop_cleanly_on_bus_error():
    """From now on, SIGBUS in this process is MESSAGE on stderr and exit status 2. Once per process:
    the handler it returns is kept by the cache, its code alive as long as the process. Compiled here,
    not at import, where loading it would start numba's compiler for nothing."""
    if not hasattr(signal, "SIGBUS"):  # (Windows: no such signal)
        return None
    try:
        handler = cfunc(types.void(types.intc), cache=True)(_on_bus_error)
    except Exception:  # (numba cannot build it on this system: a bus error keeps the system's default)
        return None
    libc = ctypes.CDLL(None)
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.signal.restype = ctypes.c_void_p
    libc.signal(signal.SIGBUS, handler.address)
    return handler
