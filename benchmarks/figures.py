"""Measure everything the docs quote, in one run, and write docs/figures.md and the README's figures block.

    python benchmarks/figures.py [--llamacpp ISA=PYTHON ...] [--rounds 3] [--rounds-7b 1]
        [--model-7b PATH] [--skip NAME ...] [--from-json NAME=FILE ...] [--save-json DIR]
        [--note TEXT] [--out docs/figures.md] [--readme README.md]

Runs, in this order (each in a process of its own, its JSON taken from its last line):
compare_llamacpp.py on the default model (`compare`), roofline.py from that run (`roofline`: the
machine's limits and each engine's fraction of them), compare_llamacpp.py on the synthetic 7B
(`compare_7b`: no turn, no code edit; benchmarks/synthetic_model.py writes it, ~10 GB of RAM while it
runs), roofline.py from that with the limits `roofline` measured (`roofline_7b`), compare_llamacpp.py
on the synthetic mixtures of experts (`compare_moe`: Qwen3-30B-A3B's first 8 layers; `compare_gptoss`:
gpt-oss-20b's first 4; SYNTHETIC says how each is written), `llama-chat bench --json` (`bench`) and
cluster.py (`cluster`: two servers behind HAProxy sharing KV through a Redis
Cluster; it needs `haproxy` and `redis-server`). `--from-json NAME=FILE` reads a source's output (a
saved run, or the whole stdout of the script) instead of running it; `--skip NAME` leaves a source
out, and its rows with it. `--save-json DIR` keeps every source's JSON, so the page can be written
again from them with `--from-json`.

Then writes --out (the CPU, the date and the commit above the tables) and rewrites the README between
its `<!-- figures:begin -->` and `<!-- figures:end -->` lines with the headline rows, made by the same
functions (figures_tables.py): no figure is typed by hand, none in two versions.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from figures_tables import figures_page, readme_block
from isa import ISAS, cpu_flags, cpu_name
from roofline import last_json

HERE = Path(__file__).parent
ROOT = HERE.parent
SOURCES = (
    "compare", "roofline", "compare_7b", "roofline_7b", "compare_moe", "compare_gptoss", "bench", "cluster"
)
SYNTHETIC_FILES = Path.home() / ".cache" / "llama-chat-bench"
SYNTHETIC_7B = SYNTHETIC_FILES / "synthetic-qwen2-7b-q4_k_m.gguf"
# the mixtures of experts, real shapes, the first layers only (per-token ratios hold, files fit in RAM):
# source → (the file, the command that writes it)
SYNTHETIC = {
    "compare_moe": (
        SYNTHETIC_FILES / "synthetic-qwen3-30b-a3b-8layers-q4_k_m.gguf",
        "benchmarks/synthetic_model.py qwen3-30b-a3b --layers 8",
    ),
    "compare_gptoss": (
        SYNTHETIC_FILES / "synthetic-gpt-oss-20b-4layers-mxfp4.gguf",
        "benchmarks/synthetic_model.py gpt-oss-20b --layers 4",
    ),
}
BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"
# The /proc/cpuinfo flags that decide which kernels run, on either engine.
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8")


def machine() -> dict:
    """What the figures were measured on, and from which code."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += " with uncommitted changes"
    from llama_chat.inference.cpu import PROFILE

    return {
        "cpu": cpu_name(),
        "vcpus": os.cpu_count(),
        "flags": [flag for flag in FLAGS if flag in cpu_flags()],
        "native_isa": PROFILE.isa,
        "date": datetime.date.today().isoformat(),
        "commit": commit,
    }


def commands(args, saved: dict[str, Path]) -> dict[str, list[str]]:
    """Each source's command line; roofline reads the compare run before it where there is one."""
    py = sys.executable
    isas = [f"--llamacpp={item}" for item in args.llamacpp]
    threads = ["--threads", str(args.threads)]
    model_7b = ["--model", str(args.model_7b)]
    big = ["--lookup-tokens", "0", "--turn-cached", "0", "--rounds", str(args.rounds_7b)]
    compare = [py, str(HERE / "compare_llamacpp.py"), *isas, *threads]

    def roofline(compare: str, *more: str) -> list[str]:
        source = ["--from-compare", str(saved[compare])] if compare in saved else [*isas, *threads]
        return [py, str(HERE / "roofline.py"), *source, *more]

    limits = ["--limits", str(saved["roofline"])] if "roofline" in saved else []
    return {
        "compare": [*compare, "--rounds", str(args.rounds)],
        "roofline": roofline("compare", "--rounds", str(args.rounds)),
        "compare_7b": [*compare, *model_7b, *big],
        "roofline_7b": roofline("compare_7b", *model_7b, *limits, "--rounds", str(args.rounds_7b)),
        **{name: [*compare, "--model", str(file), *big] for name, (file, _) in SYNTHETIC.items()},
        "bench": [py, "-m", "llama_chat", *threads, "bench", "--json"],
        "cluster": [py, str(HERE / "cluster.py"), "--rounds", str(args.rounds)],
    }


def run_source(name: str, command: list[str], folder: Path) -> Path:
    """Runs one source (its progress on stderr), keeps its stdout in folder/NAME.json."""
    print(f"figures: {name}: {' '.join(command)}", file=sys.stderr, flush=True)
    done = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"figures: {name} failed (exit status {done.returncode})")
    path = folder / f"{name}.json"
    path.write_text(done.stdout)
    return path


def collect(args, folder: Path) -> dict:
    """Every source's JSON, read from --from-json or measured now, in SOURCES' order."""
    given = dict(item.split("=", 1) for item in args.from_json)
    saved: dict[str, Path] = {name: Path(file) for name, file in given.items()}
    inputs = {}
    for name in SOURCES:
        if name in args.skip:
            continue
        if name not in saved:
            saved[name] = run_source(name, commands(args, saved)[name], folder)
        try:
            inputs[name] = last_json(saved[name].read_text())
        except (OSError, ValueError, IndexError) as error:
            raise SystemExit(f"figures: {saved[name]}: no JSON output of {name} ({error})") from None
    return inputs


def replace_block(text: str, block: str) -> str:
    """text with what lies between the BEGIN and END lines replaced by block."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {BEGIN} … {END} block")
    return text[: start + len(BEGIN)] + "\n" + block + "\n" + text[end:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--llamacpp", action="append", metavar="ISA=PYTHON", default=[], help="as compare_llamacpp.py's"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the default model's runs")
    parser.add_argument("--rounds-7b", type=int, default=1, help="rounds of the 7B's runs")
    parser.add_argument("--model-7b", type=Path, default=SYNTHETIC_7B, help="the 7B GGUF")
    parser.add_argument("--skip", action="append", default=[], choices=SOURCES, help="a source to leave out")
    parser.add_argument(
        "--from-json", action="append", default=[], metavar="NAME=FILE", help="a source's output"
    )
    parser.add_argument("--save-json", type=Path, help="a folder to keep every source's output in")
    parser.add_argument("--note", default="", help="a sentence on the run for the page (e.g. the load)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "figures.md")
    parser.add_argument(
        "--readme", type=Path, default=ROOT / "README.md", help="whose figures block to rewrite"
    )
    args = parser.parse_args()
    for item in args.llamacpp:
        if item.split("=", 1)[0] not in ISAS:
            parser.error(f"unknown ISA in --llamacpp {item} (known: {', '.join(ISAS)})")
    for item in args.from_json:
        name, _, file = item.partition("=")
        if name not in SOURCES or not Path(file).is_file():
            parser.error(
                f"--from-json {item}: wants NAME=FILE, NAME one of {', '.join(SOURCES)}, FILE a file"
            )
    given = {item.split("=")[0] for item in args.from_json}
    needs_7b = {"compare_7b", "roofline_7b"} - set(args.skip) - given
    if needs_7b and not args.model_7b.is_file():
        parser.error(f"{args.model_7b}: no such file (benchmarks/synthetic_model.py qwen2-7b writes it)")
    for name, (file, writer) in SYNTHETIC.items():
        if name not in args.skip and name not in given and not file.is_file():
            parser.error(f"{file}: no such file ({writer} writes it; or --skip {name})")
    info = machine()  # before anything is written: the commit measured
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.save_json or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        inputs = collect(args, folder)
    inputs["machine"] = {**info, "note": args.note}
    shown = [a for a in sys.argv[1:] if a not in (args.note, "--note") and not a.startswith("--note=")]
    command = shlex.join(["python", "benchmarks/figures.py", *shown])
    args.out.write_text(figures_page(inputs, command.strip()))
    readme = args.readme.read_text()
    args.readme.write_text(replace_block(readme, readme_block(inputs)))
    print(f"figures: wrote {args.out} and the figures block of {args.readme}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
