"""The pages tell users what to type and what plait prints: both must stay true.

``mkdocs build --strict`` catches a broken link or a missing API name, but not a flag a page
names that the CLI no longer takes, nor a troubleshooting line whose message was reworded in the
code. These checks read the pages and plait's own parser and string literals, run nothing, and
take about a second.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

from plait.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def _pages() -> dict[str, str]:
    """README, CONTRIBUTING, every docs page and every example's docstring, by path."""
    pages = {p.name: p.read_text() for p in [ROOT / "README.md", ROOT / "CONTRIBUTING.md",
                                              *sorted((ROOT / "docs").glob("*.md"))]}
    for path in sorted((ROOT / "examples").glob("*.py")):
        pages[f"examples/{path.name}"] = ast.get_docstring(ast.parse(path.read_text())) or ""
    return pages


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


# `plait SUB` then its words on the same line (a `\` continuation included), up to a backtick,
# a table bar or a comment; `[--flag X]` optional parts count too.
COMMAND = re.compile(r"\bplait ([a-z]+)((?:[ \t]+(?:\\\n\s*)?[^\s`|#\[\]]+|[ \t]*\[[^\]\n]*\])*)")


def documented_flags() -> list[tuple[str, str, str, argparse.ArgumentParser]]:
    """(page, command, flag, the parser that must know it) for every flag the pages give a
    plait command; for `plait run`, only those before the script (the rest are the script's)."""
    commands = _subcommands(build_parser())
    out = []
    for page, text in _pages().items():
        for match in COMMAND.finditer(text):
            name, rest = match.group(1), match.group(2)
            if name not in commands:
                continue
            parser = commands[name]
            words = rest.replace("[", " ").replace("]", " ").split()
            if name == "bench":
                if not words or words[0] not in _subcommands(parser):
                    continue
                parser, words = _subcommands(parser)[words[0]], words[1:]
            for word in words:
                if name == "run" and (word.endswith(".py") or word == "-m"):
                    break
                if re.match(r"--?[A-Za-z]", word):
                    out.append((page, name, word.split("=")[0], parser))
    return out


def test_every_flag_the_pages_give_a_command_exists():
    flags = documented_flags()
    assert len(flags) > 100  # the pattern still finds the commands
    unknown = [(page, f"plait {name} {flag}") for page, name, flag, parser in flags
               if flag not in _options(parser)]
    assert not unknown, unknown


def _code_strings() -> str:
    """Every string literal in plait/, an f-string's fields as NUL, whitespace collapsed and
    backticks dropped: the text of every message plait can print."""
    found = []
    for path in (ROOT / "plait").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.append(node.value)
            elif isinstance(node, ast.JoinedStr):
                found.append("".join(v.value if isinstance(v, ast.Constant) else "\x00"
                                     for v in node.values))
    return "\1".join(" ".join(s.replace("`", "").split()) for s in found)


# torch's own words: a message of torch's quoted beside plait's line, and torch's error text that
# plait's message carries in parentheses
NOT_PLAITS = ("Received data size doesn't match", "[transformers]")
TORCH_TEXT = ("stack expects each tensor to be equal size",)
PROSE = re.compile(r"[a-z][a-z-]*$")
SEP = r"[^\w\x00\x01]*\s[^\w\x00\x01]*"  # punctuation and a space between two words


def troubleshooting_messages() -> list[str]:
    """The backticked messages in the first column of troubleshooting.md's tables."""
    out = []
    for line in (ROOT / "docs" / "troubleshooting.md").read_text().splitlines():
        if line.startswith("| `"):
            out += re.findall(r"`([^`]+)`", line.split(" | ")[0])
    return [m for m in out if not m.startswith(NOT_PLAITS)]


def word_runs(message: str) -> list[list[str]]:
    """Every four plain words in a row (no example value, no '...' between them)."""
    for text in TORCH_TEXT:
        message = message.replace(text, "...")
    runs = []
    for piece in message.split("..."):
        words = [w.strip(",;:()") for w in piece.split()]
        runs += [words[i:i + 4] for i in range(len(words) - 3)
                 if all(PROSE.match(w) for w in words[i:i + 4])]
    return runs


def _printed(run: list[str], code: str) -> bool:
    """The words of ``run`` in order in one of plait's strings, where up to two words in a row
    may be an f-string field (an example value: 'ckpt', 'mymodels', a joined list) or, at
    either end, another string the message is put together from."""
    if " ".join(run) in code:  # most runs: no regular expression needed
        return True
    n = len(run)
    words = [re.escape(w) for w in run]
    patterns = [SEP.join(words)]
    for i in range(n):
        for j in range(i + 1, min(i + 2, n) + 1):  # at least two of the four words stay
            if i == 0:      # the start: a field, or the start of a string
                patterns.append(r"(?:\x00" + SEP + r"|\x01|^)" + SEP.join(words[j:]))
            elif j == n:    # the end: a field, or the end of a string
                patterns.append(SEP.join(words[:i]) + r"(?:" + SEP + r"\x00|\W*(?:\x01|$))")
            else:
                patterns.append(SEP.join(words[:i] + [r"\x00"] + words[j:]))
    return any(re.search(p, code) for p in patterns)


def test_every_troubleshooting_message_is_still_printed():
    """Each message holds runs of four plain words (its example values, such as 'tp=3' or
    'MyModel', fall between them); every run must still be in plait's strings. A message
    reworded in the code loses one."""
    code = _code_strings()
    messages = troubleshooting_messages()
    gone = [m for m in messages if not all(_printed(run, code) for run in word_runs(m))]
    assert sum(bool(word_runs(m)) for m in messages) > 120  # the check still reads the page
    assert not gone, gone
