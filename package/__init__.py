"""llama-chat: a terminal chat app for local LLMs, with a NumPy inference core."""

import os

__version__ = "0.1.0"

# OpenBLAS threads spin for 2^28 cycles (~0.1 s) after each call before they sleep. Decoding calls
# BLAS for a little attention between compiled kernels that want both cores, so the spinning threads
# took the cores from them (decode 10-11 tok/s); 2^16 cycles keeps them ready between the GEMMs of a
# prefill and out of the kernels' way (15-19 tok/s). Read when NumPy loads OpenBLAS, so set here first.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "16")
