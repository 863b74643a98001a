"""The text every measurement reads: prose and code, a code edit for prompt lookup, a JSON schema.

benchmarks/*.py and the real-model tests take their inputs from here too, so a figure and its test
read the same text.
"""

from __future__ import annotations

# Plain prose and code, repeated to any length: a stand-in for a real conversation's text.
SAMPLE_TEXT = """The little lighthouse keeper woke before dawn, as she had every morning for thirty years.
She climbed the spiral stairs, trimmed the wick, and watched the fishing boats slip out of the harbour.
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
When the storm came in the autumn, the whole village gathered in the tower, telling stories until
the wind dropped and the sea, grey and tired, lay down again like an old dog by the fire.
"""


# A reply that repeats code from the prompt with small edits: where prompt lookup pays.
CODE_EDIT = [
    {
        "role": "user",
        "content": """Rename `area` to `rectangle_area` everywhere and change nothing else:

```python
def area(width, height):
    \"\"\"The area of a rectangle.\"\"\"
    if width < 0 or height < 0:
        raise ValueError("negative size")
    return width * height


def describe(width, height):
    return f"{width} x {height} = {area(width, height)}"


def total_area(shapes):
    total = 0
    for width, height in shapes:
        total += area(width, height)
    return total


def largest(shapes):
    return max(shapes, key=lambda s: area(*s))
```""",
    }
]


PET_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "owner": {"type": "object", "properties": {"city": {"type": "string"}, "age": {"type": "integer"}}},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "kind", "owner", "tags"],
}


def sample_text() -> str:
    """Real, varied text: the source of a standard-library module (code, comments and docstrings),
    after the prose above. Repeated text would let the model copy, which hides cache errors."""
    import argparse

    with open(argparse.__file__, encoding="utf-8") as f:
        return SAMPLE_TEXT + f.read()


def sample_tokens(tokenizer, n: int) -> list[int]:
    text = sample_text()
    ids = tokenizer.encode(text[: n * 6])
    while len(ids) < n:
        text += text
        ids = tokenizer.encode(text[: n * 6])
    return ids[:n]
