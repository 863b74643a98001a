"""A message's text as the screen draws it: as it was written.

Markdown, with three changes to how CommonMark reads a chat's text: every line break is kept (a soft
break is a line break: a haiku stays four lines), raw HTML is shown as text (never dropped with the
lines after it), and code written without a fence is fenced (a `# comment` is no heading, and every
line stays a line with its indentation). A file attached to a message is drawn apart, folded.
"""

from __future__ import annotations

import functools
import re

from markdown_it import MarkdownIt
from markdown_it.rules_core import StateCore

# A line that only code begins so: a definition, an import, a statement of a C-like language, an
# assignment, a call alone on its line, brackets alone, a block opened with a keyword or a brace.
CODE_LINE = re.compile(
    r"""\s*(?:
        (?:def|fn|function)\s+\w+\s*\( | (?:class|struct)\s+\w+
      | import\s+[\w.]+ | from\s+[\w.]+\s+import\b
      | (?:return|raise|yield)\b | await\s+\w | (?:pass|break|continue)\s*;?\s*$
      | (?:if|elif|while|with|except)\b.*[()=<>\[\].].*:\s*$ | for\s+[\w, ]+\s+in\s+.+:\s*$
      | (?:if|for|while|switch|catch)\s*\(.*\)\s*\{?\s*$ | (?:else|try|finally)\s*[:{]
      | (?:const|let|var|pub|public|private|protected|static)\s+\w+ | \#(?:include|define)\b
      | [\w.\[\]'"]+\s*(?:[-+*/%|&^]|//|\*\*)?=(?!=)\s*\S
      | [\w.]+\(.*\)\s*;?\s*(?:(?:\#|//).*)?$ | [{}()\[\]]+[;,]?\s*$ | .*\{\s*$ | .*[=()\[\]].*;\s*$
    )""",
    re.VERBOSE,
)
ASIDE = re.compile(r"\s*(?:$|#|//)|(?: {4}|\t)(?!\s*(?:[-*+]|\d+[.)])\s)")  # blank, a comment, indented
FENCE = "```"


def hard_breaks(md: MarkdownIt) -> None:
    """A markdown-it plugin: every soft line break is a hard one (drawn as a new line)."""

    def rule(state: StateCore) -> None:
        for token in state.tokens:
            for child in token.children or ():
                if child.type == "softbreak":
                    child.type = "hardbreak"

    md.core.ruler.push("hard_breaks", rule)


@functools.cache
def markdown_parser() -> MarkdownIt:
    """The parser of a message's Markdown: GitHub's flavour, every line break kept, no raw HTML (one
    for every message: it keeps no state between texts)."""
    return MarkdownIt("gfm-like", {"html": False}).use(hard_breaks)


def fenced(text: str) -> str:
    """The text with each run of code written outside a fence fenced: the lines that begin as only
    code does, with the comments, blank and indented lines among and after them (a prose line ends a
    run; one without a line of code is left as it is)."""
    lines = text.split("\n")
    if not any(CODE_LINE.match(line) for line in lines):
        return text  # (most messages: no Markdown parsed twice)
    in_block = set()  # lines of the fenced and indented code blocks already there
    for token in markdown_parser().parse(text):
        if token.type in ("fence", "code_block") and token.map:
            in_block.update(range(*token.map))
    out, run = [], []  # the lines of the run of code and asides being read

    def close_run() -> None:
        written = [i for i, line in enumerate(run) if line.strip()]
        if any(CODE_LINE.match(line) for line in run):
            first, last = written[0], written[-1] + 1
            out.extend(run[:first] + [FENCE] + run[first:last] + [FENCE] + run[last:])
        else:
            out.extend(run)
        run.clear()

    for number, line in enumerate(lines):
        if number not in in_block and (CODE_LINE.match(line) or ASIDE.match(line)):
            run.append(line)
        else:
            close_run()
            out.append(line)
    close_run()
    return "\n".join(out)


def size_text(text: str) -> str:
    """A file's size as a person reads it: its lines and bytes ("34 lines, 1.2 kB")."""
    size = len(text.encode("utf-8"))
    lines = len(text.splitlines())
    amount = f"{size} B" if size < 1000 else f"{size / 1000:.1f} kB"
    return f"{lines:,} line{'s' if lines != 1 else ''}, {amount}"
