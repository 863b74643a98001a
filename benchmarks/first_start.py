"""CPU seconds a first start compiles before its first reply, and what it leaves to a thread (not CI).

    NUMBA_CACHE_DIR=$(mktemp -d) python benchmarks/first_start.py [--model NAME|PATH] [--activations A]

Loads the model as the app does (app/chat/build.load_chat_model: what the first reply takes compiled as
it loads, the rest on the compile-later thread), then replies greedily to a short chat message, and
prints the CPU seconds of numba's compiles by thread (each compile's thread CPU time, from numba's
compile events), the process's CPU seconds to the loaded model and to the reply, and again once the
compile-later thread is done. With an empty NUMBA_CACHE_DIR it is a first start; else a later one.
CPU time, not wall: on a shared machine the wall time says more about the other work than about ours.
"""

from __future__ import annotations

import argparse
import resource
import threading
import time

from numba.core import event


def process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class CompileTimes(event.Listener):
    """CPU seconds of numba's outermost compiles, by thread name."""

    def __init__(self):
        self.local, self.by_thread = threading.local(), {}

    def on_start(self, _event) -> None:
        self.local.__dict__.setdefault("started", []).append(time.thread_time())

    def on_end(self, _event) -> None:
        seconds = time.thread_time() - self.local.started.pop()
        if not self.local.started:
            name = threading.current_thread().name
            self.by_thread[name] = self.by_thread.get(name, 0.0) + seconds


def main() -> int:
    from llama_chat.inference.activation_modes import ACTIVATIONS, DEFAULT_ACTIVATIONS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="a known model name or a GGUF path (default: the default)"
    )
    parser.add_argument("--activations", choices=ACTIVATIONS, default=DEFAULT_ACTIVATIONS)
    args = parser.parse_args()
    compiles = CompileTimes()
    event.register("numba:compile", compiles)
    start = process_cpu()
    from llama_chat.app.chat.build import load_chat_model
    from llama_chat.inference import SamplingParams, chat_prompt_ids, generate

    model = load_chat_model(args.model, activations=args.activations)
    loaded = process_cpu() - start
    ids = chat_prompt_ids(model, [{"role": "user", "content": "Say hello."}])
    reply = "".join(generate(model, ids, sampling=SamplingParams(temperature=0), max_tokens=8))
    replied = process_cpu() - start
    first = {name: round(seconds, 1) for name, seconds in compiles.by_thread.items()}
    for thread in threading.enumerate():
        if thread.name == "compile-later":
            thread.join()
    every = {name: round(seconds, 1) for name, seconds in compiles.by_thread.items()}
    print(f"{model.name}, --activations {args.activations}: {reply!r}")
    print(f"process CPU s: {loaded:.1f} to the loaded model, {replied:.1f} to the reply, "
          f"{process_cpu() - start:.1f} with the compile-later thread done")
    print(f"compile CPU s by thread: {first} to the reply, {every} in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
