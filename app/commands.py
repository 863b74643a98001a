"""The headless sub-commands: models, ask, chat, tokenize, bench."""

from __future__ import annotations

import sys
import threading

from llama_chat.inference import (
    KNOWN_MODELS,
    GenerationStats,
    SamplingParams,
    chat_prompt_ids,
    generate,
    load_model,
)
from llama_chat.inference.catalog import model_status

from .cli import print_json
from .progress import ProgressBar


def cmd_models(args) -> int:
    statuses = [model_status(m) for m in KNOWN_MODELS.values()]
    if args.json:
        print_json(statuses)
        return 0
    for s in statuses:
        state = "verified" if s["verified"] else "assembled" if s["assembled"] else "not assembled"
        if not s["packages_installed"] and not s["assembled"]:
            state = "packages not installed"
        print(f"{s['name']:40} {state:22} {s['path']}")
        print(f"  {s['description']}")
    return 0


def open_model(args):
    with ProgressBar() as bar:
        return load_model(args.model, progress=bar)


def read_text(value: str) -> str:
    return sys.stdin.read() if value == "-" else value


def sampling_params(args) -> SamplingParams:
    return SamplingParams(
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        seed=args.seed,
    )


def stream_reply(model, messages, cache, args) -> tuple[str, GenerationStats]:
    """Stream one reply to stdout; Ctrl+C stops it and keeps what was generated."""
    ids = chat_prompt_ids(model, messages)
    stats = GenerationStats()
    cancel = threading.Event()
    pieces = []
    try:
        for piece in generate(
            model,
            ids,
            seq=cache,
            sampling=sampling_params(args),
            max_tokens=args.max_tokens,
            cancel=cancel,
            stats=stats,
        ):
            pieces.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:
        stats.stop_reason = "cancelled"
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(
        f"[{stats.prompt_tokens} prompt tokens, {stats.prefilled_tokens} prefilled at {stats.prefill_tok_s:.1f} tok/s; "
        f"{stats.generated_tokens} generated at {stats.decode_tok_s:.1f} tok/s; stop: {stats.stop_reason}]",
        file=sys.stderr,
    )
    return "".join(pieces), stats


def first_messages(args) -> list[dict]:
    return [{"role": "system", "content": args.system}] if args.system else []


def cmd_ask(args) -> int:
    prompt = read_text(args.prompt)
    model = open_model(args)
    messages = first_messages(args) + [{"role": "user", "content": prompt}]
    stream_reply(model, messages, model.new_sequence(args.ctx), args)
    return 0


def cmd_chat(args) -> int:
    model = open_model(args)
    cache = model.new_sequence(args.ctx)
    messages = first_messages(args)
    print(f"Chatting with {model.name}. Ctrl+D ends, Ctrl+C stops a reply.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply, _ = stream_reply(model, messages, cache, args)
        messages.append({"role": "assistant", "content": reply})


def cmd_tokenize(args) -> int:
    text = read_text(args.text)
    model = open_model(args)
    print_json(
        model.tokenizer.encode(text, add_bos=args.bos and model.tokenizer.add_bos, special=args.special)
    )
    return 0


def cmd_bench(args) -> int:
    from .bench import run_bench

    return run_bench(args)
