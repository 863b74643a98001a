"""How often the default model answers a plain request with a question back, with the app's defaults
for a new chat (the model's recommended sampling and system prompt): N sampled replies to five plain
requests, each flagged when it is only a question (no code, and its text ends with "?").

    python benchmarks/questions_back.py [--samples 4] [--system TEXT]   # --system "": none
Prints one line per reply, then a JSON object on its last line."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from llama_chat.app.chat.settings import model_sampling, sampling_params
from llama_chat.inference import chat_prompt_ids, generate, load_model
from llama_chat.inference.catalog import recommended_system_prompt

REQUESTS = [
    "How do I read a CSV file in Python and sum one column?",
    "Reverse a string in Python.",
    "What is a prime number?",
    "Explain what a hash table is.",
    "Write a function that checks if a number is even.",
]


def only_a_question(reply: str) -> bool:
    return "```" not in reply and reply.strip().endswith("?")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=4, help="replies per request")
    parser.add_argument("--system", default=None, help="system prompt (default: the model's; '' for none)")
    args = parser.parse_args()
    model = load_model()
    system = recommended_system_prompt(model.path) if args.system is None else args.system
    sampling = sampling_params({}, model_sampling(model))
    flagged = 0
    for request in REQUESTS:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": request}
        ]
        prompt = chat_prompt_ids(model, messages)
        for seed in range(args.samples):
            reply = "".join(generate(model, prompt, sampling=replace(sampling, seed=seed), max_tokens=80))
            flagged += only_a_question(reply)
            print(f"{'QUESTION' if only_a_question(reply) else 'answer  '} {request[:30]!r}: {reply[:90]!r}")
    total = len(REQUESTS) * args.samples
    print(json.dumps({"replies": total, "only_a_question": flagged, "system_prompt": system}))


if __name__ == "__main__":
    main()
