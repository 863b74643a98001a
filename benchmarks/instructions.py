"""Which default system prompt makes the default model do what plain requests ask (not CI): each
request has a rule its answer must pass (one word, N bullet points, valid JSON, a number, no question
back, code that runs, the language asked for), answered greedily and sampled with the model's
recommended sampling, under each candidate system prompt; the score is the share of answers that pass.

    python benchmarks/instructions.py [--samples 2] [--only N] [--prompts NAME,...] [--out DIR] [--json]

--only N answers every N-th request (a short sample, for a busy machine); --samples 0 is greedy only.
Each answer is appended to DIR/<candidate>.jsonl as it is written, and a run given the same DIR goes on
from what is there (the rules judge the saved replies again each time). Prints a Markdown table (a row
per candidate, a column per kind of request: greedy passed, sampled passed), then (--json) a JSON object.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from llama_chat.app.chat.settings import model_sampling, sampling_params
from llama_chat.inference import GenerationStats, SamplingParams, chat_prompt_ids, load_model
from llama_chat.inference.catalog import DEFAULT_MODEL, KNOWN_MODELS
from llama_chat.inference.generate import ReplyStream, run_streams, start_streams
from llama_chat.inference.kernels import KERNEL_ROWS

MAX_TOKENS = 200
# The candidates: None is the chat template's own (Qwen's: "You are Qwen, created by Alibaba Cloud…").
PROMPTS = {
    "template's own": None,
    "answer with the solution": (
        "You are a helpful assistant. When the user asks for something, do it: "
        "answer with the solution, not with a question."
    ),
    "exactly as asked": (
        "You are a helpful assistant. Do exactly what the user asks, in the form, length and language "
        "asked for. Give the answer itself, never a question back."
    ),
    "a helpful assistant": "You are a helpful assistant.",
    "answer first": KNOWN_MODELS[DEFAULT_MODEL].system_prompt,  # the default: it scored best here
    # the template's own, which keeps one-word answers, and the one sentence against questions back
    "Qwen's + answer itself": (
        "You are Qwen, created by Alibaba Cloud. You are a helpful assistant. "
        "Reply with the answer itself, never with a question."
    ),
    "answer itself": "You are a helpful assistant. Reply with the answer itself, never with a question.",
}


@dataclass(frozen=True)
class Request:
    kind: str
    text: str
    passes: Callable[[str], bool]


def _words(reply: str) -> list[str]:
    return re.findall(r"[\w'-]+", reply.lower())


def one_word(word: str) -> Callable[[str], bool]:
    return lambda reply: _words(reply) == [word]


def bullets(n: int) -> Callable[[str], bool]:
    return lambda reply: len(re.findall(r"(?m)^\s*(?:[-*•]|\d+[.)])\s+\S", reply)) == n


def _fenced_or_whole(reply: str) -> str:
    block = re.search(r"```(?:\w+)?\n(.*?)```", reply, re.DOTALL)
    return block.group(1) if block else reply


def json_with(keys: set[str]) -> Callable[[str], bool]:
    def passes(reply: str) -> bool:
        try:
            value = json.loads(_fenced_or_whole(reply).strip())
        except ValueError:
            return False
        return isinstance(value, dict) and keys <= set(value)

    return passes


def number(value: float) -> Callable[[str], bool]:
    def passes(reply: str) -> bool:
        found = re.findall(r"-?\d+(?:\.\d+)?", reply.replace(",", ""))
        return len(found) == 1 and abs(float(found[0]) - value) < 1e-6

    return passes


def no_question_back(reply: str) -> bool:
    return bool(reply.strip()) and not ("```" not in reply and reply.strip().endswith("?"))


def _limits() -> None:  # in the child: model-written code gets 5 s of CPU and 512 MB
    resource.setrlimit(resource.RLIMIT_CPU, (5, 5))
    resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20))


def code_that(test: str) -> Callable[[str], bool]:
    """The reply's Python (its fenced block, else all of it), run in an isolated child with `test` after
    it: passes when the test's asserts hold."""

    def passes(reply: str) -> bool:
        code = _fenced_or_whole(reply) + "\n" + test + "\n"
        with tempfile.TemporaryDirectory() as folder:
            try:
                run = subprocess.run([sys.executable, "-I", "-c", code], cwd=folder, capture_output=True,
                                     timeout=10, preexec_fn=_limits)
            except subprocess.TimeoutExpired:
                return False
        return run.returncode == 0

    return passes


def in_language(*words: str) -> Callable[[str], bool]:
    """Written in the language asked for: it holds one of that language's common words."""
    return lambda reply: any(w in _words(reply) for w in words)


FRENCH = ("le", "la", "les", "est", "et", "un", "une", "des", "du")
SPANISH = ("el", "la", "los", "las", "es", "y", "un", "una", "del")
GERMAN = ("der", "die", "das", "ist", "und", "ein", "eine", "nicht")

REQUESTS = [
    *(
        Request("one word", f"Reply with the single word: {w}", one_word(w))
        for w in ("banana", "yes", "blue", "seven", "python", "hello", "stop", "orange")
    ),
    Request("one word", "What is the capital of France? Answer with one word.", one_word("paris")),
    Request("one word", "Name the largest planet in the solar system, in one word.", one_word("jupiter")),
    *(
        Request("bullets", f"List exactly {n} {what} as bullet points, nothing else.", bullets(n))
        for n, what in (
            (3, "fruits"),
            (4, "colours"),
            (2, "programming languages"),
            (5, "animals"),
            (3, "rivers"),
            (4, "vegetables"),
            (3, "sorting algorithms"),
            (2, "planets"),
        )
    ),
    *(
        Request(
            "JSON",
            f"Reply with only a JSON object with the keys {', '.join(keys)} for {what}.",
            json_with(set(keys)),
        )
        for keys, what in (
            (("name", "age"), "a made-up person"),
            (("title", "year"), "a film"),
            (("city", "country"), "a city"),
            (("x", "y"), "a point"),
            (("language", "typing"), "Python"),
            (("id", "done", "task"), "a to-do item"),
            (("red", "green", "blue"), "the colour purple"),
            (("width", "height"), "a rectangle"),
        )
    ),
    *(
        Request("number", f"{q} Reply with the number only.", number(v))
        for q, v in (
            ("What is 17 + 25?", 42),
            ("What is 9 times 8?", 72),
            ("How many days are in a week?", 7),
            ("What is 100 divided by 4?", 25),
            ("What is 2 to the power of 10?", 1024),
            ("How many minutes are in an hour?", 60),
            ("What is 15 - 6?", 9),
            ("How many legs does a spider have?", 8),
            ("What is the square root of 81?", 9),
            ("How many sides does a hexagon have?", 6),
        )
    ),
    *(
        Request("no question back", text, no_question_back)
        for text in (
            "What is the difference between a list and a tuple?",
            "Reverse a string in Python.",
            "Explain what a hash table is.",
            "How do I read a CSV file in Python and sum one column?",
            "What is a prime number?",
            "Write a function that checks if a number is even.",
            "Tell me about recursion.",
            "How do I undo the last git commit?",
            "What does HTTP 404 mean?",
            "Describe a binary search.",
        )
    ),
    *(
        Request("code that runs", text, code_that(test))
        for text, test in (
            ("Write a Python function add(a, b) that returns their sum.", "assert add(2, 3) == 5"),
            (
                "Write a Python function is_even(n) that returns True for even numbers.",
                "assert is_even(4) and not is_even(7)",
            ),
            (
                "Write a Python function reverse(s) that returns the string reversed.",
                "assert reverse('abc') == 'cba'",
            ),
            ("Write a Python function factorial(n).", "assert factorial(5) == 120 and factorial(0) == 1"),
            (
                "Write a Python function is_palindrome(s) that ignores case.",
                "assert is_palindrome('Level') and not is_palindrome('abc')",
            ),
            (
                "Write a Python function largest(xs) that returns the largest number of a list.",
                "assert largest([3, 9, 2]) == 9",
            ),
            ("Write a Python function count_vowels(s).", "assert count_vowels('education') == 5"),
            (
                "Write a Python function fib(n) returning the n-th Fibonacci number, fib(0) = 0.",
                "assert [fib(i) for i in range(7)] == [0, 1, 1, 2, 3, 5, 8]",
            ),
            ("Write a Python function celsius_to_fahrenheit(c).", "assert celsius_to_fahrenheit(100) == 212"),
            (
                "Write a Python function unique(xs) that returns the items of a list "
                "without repeats, in order.",
                "assert unique([1, 2, 1, 3, 2]) == [1, 2, 3]",
            ),
        )
    ),
    # the language's common words, or the answer's own word in it (a one-word answer is an answer too)
    *(
        Request("language", f"Answer in {lang}: {q}", in_language(*words, *answer))
        for lang, q, words, answer in (
            ("French", "what colour is the sky?", FRENCH, ("bleu",)),
            ("Spanish", "what colour is the sky?", SPANISH, ("azul",)),
            ("German", "what colour is the sky?", GERMAN, ("blau",)),
            ("French", "what is a cat?", FRENCH, ("chat",)),
            ("Spanish", "what is water?", SPANISH, ("agua",)),
            ("German", "what is a house?", GERMAN, ("haus",)),
            ("French", "name a fruit and its colour.", FRENCH, ("pomme", "rouge", "jaune")),
            ("Spanish", "what day comes after Monday?", SPANISH, ("martes",)),
        )
    ),
]


@dataclass
class Answer:
    """One answer being written: to which request, how (greedy, or sampled with a seed), its text."""

    request: Request
    seed: int | None  # None: greedy
    stream: ReplyStream
    pieces: list[str] = field(default_factory=list)

    def record(self) -> dict:
        return {"request": self.request.text, "seed": self.seed, "reply": "".join(self.pieces)}


def start_answers(model, system: str | None, request: Request, samplings: dict) -> list[Answer]:
    """The answers to one request, one per sampling ({seed or None: params}), its prompt prefilled once."""
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": request.text}
    ]
    ids = chat_prompt_ids(model, messages)
    base = model.new_sequence(len(ids) + MAX_TOKENS + 1)
    logits = [row for _, row in model.prefill(ids, base)][-1]
    answers = [
        Answer(request, seed, start_streams(model, ids, base.fork(), logits, [GenerationStats()],
                                            sampling=params, stop=(), max_tokens=MAX_TOKENS, lookup=False)[0])
        for seed, params in samplings.items()
    ]
    base.free()
    return answers


def answer_all(model, work: list[tuple[Request, dict]], system: str | None) -> Iterator[Answer]:
    """Every answer of `work` (requests, each with its samplings), finished ones as they finish. Answers
    are decoded together, a forward pass for up to KERNEL_ROWS of them: each row has the bits decoding
    it alone gives (Model.verify_rows), so an answer is the one generate() writes, at a fraction of the
    passes."""
    todo, active = list(work), []
    while todo or active:
        while todo and len(active) + len(todo[0][1]) <= KERNEL_ROWS:
            active += start_answers(model, system, *todo.pop(0))
        for answer in active:
            answer.pieces += answer.stream.advance(None)
            if answer.stream.done:
                answer.stream.seq.free()
                yield answer
        active = [a for a in active if not a.stream.done]
        run_streams(model, [a.stream for a in active])


def saved(path: Path) -> list[dict]:
    """The answers a run already wrote to `path` (one JSON object a line; a line cut short is dropped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def run_candidate(model, name: str, requests: list[Request], samplings: dict, path: Path) -> list[dict]:
    """Every answer of one candidate prompt ({"request", "seed", "reply"}): those saved in `path` and
    the rest, each appended to `path` as it is written, so a run stopped part way goes on where it was."""
    records = saved(path)
    done = {(r["request"], r["seed"]) for r in records}
    work = []
    for q in requests:
        if todo := {s: p for s, p in samplings.items() if (q.text, s) not in done}:
            work.append((q, todo))
    print(f"{name}: {len(records)} answers saved, {sum(len(t) for _, t in work)} to write", file=sys.stderr)
    with path.open("a") as out:
        for answer in answer_all(model, work, PROMPTS[name]):
            record = answer.record()
            out.write(json.dumps(record) + "\n")
            out.flush()
            records.append(record)
            how = "greedy" if answer.seed is None else f"seed {answer.seed}"
            verdict = "pass" if answer.request.passes(record["reply"]) else "FAIL"
            line = f"  {verdict} {record['request'][:40]!r} ({how}): {record['reply'][:70]!r}"
            print(line, file=sys.stderr)
    wanted = {(q.text, s) for q in requests for s in samplings}
    return [r for r in records if (r["request"], r["seed"]) in wanted]


def tally(records: list[dict]) -> dict:
    """{kind: {"greedy": [passed, answered], "sampled": [...]}} of saved answers, each judged now by its
    request's rule, kinds in the order of REQUESTS."""
    by_text = {q.text: q for q in REQUESTS}
    out: dict[str, dict[str, list[int]]] = {}
    for kind in dict.fromkeys(q.kind for q in REQUESTS):
        for r in (r for r in records if by_text[r["request"]].kind == kind):
            counts = out.setdefault(kind, {"greedy": [0, 0], "sampled": [0, 0]})
            count = counts["greedy" if r["seed"] is None else "sampled"]
            count[0], count[1] = count[0] + by_text[r["request"]].passes(r["reply"]), count[1] + 1
    return out


def _total(kinds: dict, mode: str) -> tuple[int, int]:
    return sum(k[mode][0] for k in kinds.values()), sum(k[mode][1] for k in kinds.values())


def table(results: dict[str, dict]) -> str:
    """The scores as a Markdown table: a row per candidate, a column per kind (greedy, sampled)."""
    kinds = list(dict.fromkeys(k for r in results.values() for k in r))
    lines = ["| candidate | overall | greedy | sampled | " + " | ".join(kinds) + " |",
             "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in kinds) + " |"]
    for name, r in results.items():
        (g, gn), (sp, sn) = _total(r, "greedy"), _total(r, "sampled")
        cells = [f"{r[k]['greedy'][0]}/{r[k]['greedy'][1]}, {r[k]['sampled'][0]}/{r[k]['sampled'][1]}"
                 if k in r else "" for k in kinds]
        overall = f"{100 * (g + sp) / max(gn + sn, 1):.0f} %"
        lines.append(f"| {name} | {overall} | {g}/{gn} | {sp}/{sn} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--samples", type=int, default=2, help="sampled answers per request, beside the greedy one"
    )
    parser.add_argument("--only", type=int, default=1, metavar="N", help="every N-th request only")
    parser.add_argument("--prompts", default=",".join(PROMPTS), help="candidates, by name")
    parser.add_argument("--out", type=Path, default=None, help="folder for the answers (resumes from it)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    names = args.prompts.split(",")
    if unknown := [n for n in names if n not in PROMPTS]:
        sys.exit(f"instructions.py: no candidate prompt {unknown[0]!r} (there are: {', '.join(PROMPTS)})")
    model = load_model()
    folder = args.out or Path(tempfile.mkdtemp(prefix="instructions-"))
    folder.mkdir(parents=True, exist_ok=True)
    sampled = sampling_params({}, model_sampling(model))
    samplings = {None: SamplingParams(temperature=0)}
    samplings |= {s: replace(sampled, seed=s) for s in range(args.samples)}
    requests = REQUESTS[:: args.only]
    results = {}
    for name in names:
        path = folder / (re.sub(r"\W+", "-", name).strip("-") + ".jsonl")
        results[name] = tally(run_candidate(model, name, requests, samplings, path))
    print(table(results))
    if args.json:
        print(json.dumps({"requests": len(requests), "samplings": len(samplings), "results": results}))


if __name__ == "__main__":
    main()
