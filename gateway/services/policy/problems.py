"""What a policy file's errors say: `file:line: message`, every problem found at once, quoting
at most a short, clipped piece of the file (a file in the directory may be no policy)."""

from __future__ import annotations

import difflib
import re


class PolicyError(Exception):
    """One or more problems in the policy files, each ``"file:line: message"``."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


class Problems:
    """The problems every reader of a load reports into, each ``(file, line, message)``:
    one collector shared by the readers of every file, so all problems are said at once."""

    def __init__(self) -> None:
        self.errors: list[tuple[str, int, str]] = []

    def add(self, file: str, line: int, message: str) -> None:
        self.errors.append((file, line, message))

    def raise_any(self) -> None:
        """Raise the ``PolicyError`` listing every problem, if there is one."""
        if self.errors:
            raise PolicyError(format_errors(self.errors))


KEY_SHOWN = 40  # characters of a key an error quotes


SHOWN = 64  # characters of any other value from a file an error quotes


_REPR = re.compile(r"'(?:[^'\\\n]|\\.)*'" + r'|"(?:[^"\\\n]|\\.)*"')  # quoted values


def printable(text: str, limit: int) -> str:
    clean = "".join(c if c.isprintable() else "?" for c in text)  # no controls, no bidi
    return clean if len(clean) <= limit else clean[: limit - 3] + "..."


def shown(value: object, limit: int = SHOWN) -> str:
    """A value from a policy file as an error quotes it: in double quotes, printable
    characters only, at most ``limit`` of them. Errors never echo more of a file than
    that: a file in the directory may be no policy at all (or hold a secret)."""
    text = value if isinstance(value, str) else repr(value)
    return '"' + printable(text.replace('"', "'"), limit) + '"'


def quoted(value: object, limit: int = SHOWN) -> str:
    """``repr(value)`` of a value from a file, clipped like ``shown``."""
    text = repr(value)
    if len(text) <= limit and text.isprintable():
        return text
    return printable(text, limit - 1) + (text[0] if text[0] in "'\"" else "")


def clipped(message: str) -> str:
    """A library's error about a value (host and path patterns, durations, YAML), its
    quoted values clipped like ``quoted`` and the whole bounded."""
    out = _REPR.sub(lambda m: m.group() if len(m.group()) <= SHOWN else
                    printable(m.group(), SHOWN - 1) + m.group()[0], message)
    return printable(out, 300)


def suggest(word: str, choices: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f' (did you mean "{close[0]}"?)' if close else ""


def format_errors(errors: list[tuple[str, int, str]]) -> list[str]:
    """``file:line: message`` lines, grouped by file in line order, duplicates dropped."""
    order = {file: i for i, (file, _, _) in reversed(list(enumerate(errors)))}
    ranked = sorted(dict.fromkeys(errors), key=lambda e: (order[e[0]], e[1]))
    return [f"{file}:{line}: {message}" for file, line, message in ranked]
