"""`llama-chat bench`'s measurements: only the `bench` command imports this package (lazily), and
benchmarks/*.py and the real-model tests take their inputs from it."""

from .run import run_bench

__all__ = ["run_bench"]
