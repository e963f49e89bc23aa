"""What a sandbox sent before (`core/dlp/history.py`): the long strings of its JSON bodies
that held nothing are left out of the next body's first reading. Held to the scan
without it over conversations of many turns (credentials planted in new turns, in
strings beside remembered ones, split across strings, as a name beside its value), per
sandbox and per selection of detectors, and bounded."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

import pytest
from helpers.dlp_corpus import DEFAULT_CORPUS, fake

from gateway.core.dlp import DEFAULT, Scanner
from gateway.core.dlp import jsondoc as jsondoc_module
from gateway.core.dlp.history import SHORTEST, History
from gateway.services.dlp.library import build

pytestmark = pytest.mark.skipif(not jsondoc_module.NATIVE, reason="no C reading built")

JSON = "application/json"
DETECTORS = build(DEFAULT)
SOURCES = [Path(json.__file__).parent / name for name in ("decoder.py", "encoder.py",
                                                           "scanner.py", "__init__.py")]
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
PEM = fake("private-key").text
CALL = " call_Xy7Qz3abCDef12GhIjKlMn"  # (a run: a body without one stops at the gate)


def _code(r: random.Random, size: int) -> str:
    text = r.choice(SOURCES).read_text()
    at = r.randrange(len(text) - size)
    return text[at:at + size]


def _planted(r: random.Random) -> list[object]:
    """A message's content holding a credential some way a scan must still find: in a
    long string, base64 in it, or across two strings side by side (a private key's
    header and body, a name and its value, a key cut in two)."""
    key = r.choice(DEFAULT_CORPUS).text
    kind = r.randrange(5)
    if kind == 0:
        return [f"{_code(r, 300)} {key} {_code(r, 50)}"]
    if kind == 1:
        return [_code(r, 400) + " " + base64.b64encode(key.encode()).decode()]
    if kind == 2:  # a private key's header ending one string, its body the next
        header, _, rest = PEM.partition("\n")
        return [[_code(r, 300) + "\n" + header, rest]]
    if kind == 3:  # a name beside its value, the name at the end of a long string
        return [[_code(r, 300) + "\nAWS_SECRET_ACCESS_KEY = ", AWS_SECRET]]
    return [[f"{_code(r, 280)}\n{key[:len(key) // 2]}", key[len(key) // 2:]]]


def _conversation(seed: int, turns: int) -> list[bytes]:
    """The bodies an agent sends, turn after turn: its whole history and a new turn (a
    tool call with a new id and a file's slice). One turn in four plants a credential
    (`_planted`), beside the history's strings or inside it (right after a string it
    may be read with); such a request is refused, so its turn does not stay."""
    r = random.Random(seed)
    messages: list[dict[str, object]] = [
        {"role": "system", "content": "You are a coding agent. " + _code(r, 600)},
        {"role": "user", "content": "Fix the decoder."}]
    bodies = []
    for _ in range(turns):
        call = "call_" + "".join(r.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                          "0123456789") for _ in range(24))
        turn: list[dict[str, object]] = [{"role": "assistant", "content": None, "tool_calls": [{
            "id": call, "type": "function",
            "function": {"name": "read_file", "arguments": json.dumps({"path": "x.py"})}}]}]
        planted = r.random() < 0.25
        contents = _planted(r) if planted else [_code(r, r.choice([100, 700]))]
        turn += [{"role": "tool", "tool_call_id": call, "content": c} for c in contents]
        if planted and r.random() < 0.5:  # (inside the history, after one of its strings)
            at = r.randrange(1, len(messages) + 1)
            sent = messages[:at] + turn + messages[at:]
        else:
            sent = messages + turn
        body = {"model": "gpt-4o", "messages": sent, "stream": True}
        bodies.append(json.dumps(body, ensure_ascii=r.random() < 0.5).encode())
        if not planted:
            messages += turn
        elif r.random() < 0.2:  # (refused, the agent reads another file instead)
            messages += [turn[0], {"role": "tool", "tool_call_id": call,
                                   "content": _code(r, 300)}]
    return bodies


def _scan(scanner: Scanner, body: bytes, sandbox: str | None) -> tuple[tuple[str, str], ...]:
    return tuple((f.detector, f.fingerprint) for f in
                 scanner.scan_body(body, JSON, sandbox=sandbox).findings)


@pytest.mark.parametrize("seed", range(6))
def test_a_conversation_is_scanned_as_without_the_history(seed: int) -> None:
    """Every turn's findings with the history equal those of a scanner without it, and
    the history leaves strings out (the test would pass vacuously without)."""
    plain = Scanner(DETECTORS, b"salt")
    remembering = Scanner(DETECTORS, b"salt", history=History())
    left_out = found = 0
    for body in _conversation(seed, 40):
        expected = _scan(plain, body, None)
        assert _scan(remembering, body, f"sandbox-{seed}") == expected, body[-400:]
        found += bool(expected)
        assert remembering.history is not None
        reading = remembering.history.read(body, hash((f"sandbox-{seed}",
                                                       remembering.selection)))
        left_out += len(reading.cuts) if reading is not None else 0
    assert left_out > 200 and 2 < found < 30, (left_out, found)


def test_a_string_a_window_reads_across_is_not_left_out_of_that_window() -> None:
    """A private key's body remembered (it holds nothing alone), then its header sent
    right before it: the header's window reaches where the body was left out, so the
    body is read whole, and the key is found."""
    header, _, rest = PEM.partition("\n")
    rest = "\n".join([rest] * 4)  # (a longer key: its body is remembered, SHORTEST)
    scanner = Scanner(DETECTORS, b"salt", history=History(slots=1 << 20))  # (no two in a slot)
    filler = "x = 1\n" * 60
    first = json.dumps({"messages": [filler, rest]}).encode()
    assert not scanner.scan_body(first, JSON, sandbox="s").findings
    assert scanner.history is not None and scanner.history.size()[0] == 2
    second = json.dumps({"messages": [filler, header, rest]}).encode()
    reading = scanner.history.read(second, hash(("s", scanner.selection)))
    assert reading is not None and reading.text == "messages\n" + header
    assert scanner.prefilter.reading(reading.text, reading.cuts) is None
    assert [f.detector for f in scanner.scan_body(second, JSON, sandbox="s").findings] \
        == ["private-key"]


def test_a_name_left_out_still_makes_the_name_rules_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A long string holding an anchor of the rules that read a name beside its value
    (`AWS` far from its ends: no window leaves it, so it is remembered) is noted so; a
    body it is left out of still makes those rules' pass over the whole text. (A name
    at a string's end is never remembered: its window reaches past the end.)"""
    scanner = Scanner(DETECTORS, b"salt", history=History())
    name = "# settings\n" * 30 + "AWS_REGION = 'x'\n" + "# more\n" * 30 + CALL
    assert not scanner.scan_body(json.dumps([name]).encode(), JSON, sandbox="s").findings
    body = json.dumps([name, "z = 1"]).encode()
    assert scanner.history is not None
    reading = scanner.history.read(body, hash(("s", scanner.selection)))
    assert reading is not None and reading.cuts and reading.named
    passes: list[str] = []
    context = Scanner._context
    monkeypatch.setattr(Scanner, "_context", lambda self, text, *a, **k: (
        passes.append(text), context(self, text, *a, **k))[1])
    assert not scanner.scan_body(body, JSON, sandbox="s").findings
    assert len(passes) == 1 and "AWS_REGION" in passes[0]
    ending = "# settings\n" * 30 + CALL + "\nAWS_SECRET_ACCESS_KEY = "
    scanner.scan_body(json.dumps([ending]).encode(), JSON, sandbox="s")
    assert [f.detector for f in scanner.scan_body(json.dumps([ending, AWS_SECRET]).encode(),
                                                  JSON, sandbox="s").findings] == ["aws"]


def test_what_one_sandbox_sent_is_not_left_out_for_another() -> None:
    """A string is remembered for one sandbox and one selection of detectors: another
    sandbox's body, or the same body under another selection, is read whole."""
    scanner = Scanner(DETECTORS, b"salt", history=History())
    body = json.dumps({"content": "y = 2\n" * 100 + CALL}).encode()
    assert not scanner.scan_body(body, JSON, sandbox="a").findings
    history = scanner.history
    assert history is not None

    def cuts(sandbox: str, selection: Scanner) -> list[int]:
        reading = history.read(body, hash((sandbox, selection.selection)))
        assert reading is not None
        return reading.cuts

    github = scanner.only(["github"])
    assert github.history is history
    assert cuts("a", scanner) and not cuts("b", scanner) and not cuts("a", github)


def test_only_long_strings_that_held_nothing_are_remembered() -> None:
    """Strings shorter than `SHORTEST` bytes as sent are read again each time, and a
    body with a finding remembers none of its strings."""
    scanner = Scanner(DETECTORS, b"salt", history=History())
    assert scanner.history is not None
    short = json.dumps(["z" * (SHORTEST - 1 - len(CALL)) + CALL]).encode()
    scanner.scan_body(short, JSON, sandbox="s")
    assert scanner.history.size() == (0, 0)
    secret = json.dumps(["q = 3\n" * 60 + CALL, fake("github").text]).encode()
    assert scanner.scan_body(secret, JSON, sandbox="s").findings
    assert scanner.history.size() == (0, 0)
    scanner.scan_body(json.dumps(["q = 3\n" * 60 + CALL]).encode(), JSON, sandbox="s")
    assert scanner.history.size() == (1, 60 * 7 + len(CALL))  # (as sent: `\\n` is two)


def test_the_history_is_bounded() -> None:
    """Past `limit` bytes every string is let go; a slot holds one string (a new one
    takes its place); a string longer than the limit is never held."""
    history = History(slots=16, limit=4096, shortest=32)
    scanner = Scanner(DETECTORS, b"salt", history=history)
    for i in range(500):
        body = json.dumps([f"{i:05d} " + "w = 4\n" * (10 + i % 50) + CALL]).encode()
        scanner.scan_body(body, JSON, sandbox="s")
        held, size = history.size()
        assert held <= 16 and size <= 4096
    history.forget()
    assert history.size() == (0, 0)
    scanner.scan_body(json.dumps(["v = 5\n" * 1000 + CALL]).encode(), JSON, sandbox="s")
    assert history.size() == (0, 0)


@pytest.mark.parametrize("arguments", [(16, 1 << 20, 31), (15, 1 << 20, 256),
                                       (0, 1 << 20, 256), (16, 100, 256)])
def test_a_memo_of_impossible_sizes_is_refused(arguments: tuple[int, int, int]) -> None:
    native = jsondoc_module.native()
    with pytest.raises(ValueError):
        native.Memo(*arguments)


def test_the_reading_leaves_out_exactly_the_strings_remembered() -> None:
    """`Memo.read`: the text `texts` reads, less the strings remembered (compared as
    sent, escapes and all), with a cut where each was and the fresh strings' places in
    the text and the body, over random documents of long and short strings, escaped,
    past ASCII, first and last, keys and values."""
    native = jsondoc_module.native()
    r = random.Random(5)
    pool = ["é" * 40, "a\\b\"c" * 12, "\U0001F600 wide " * 6, "plain " * 9, "k" * 31,
            "\ud800 lone " * 5, "short", "", "line\nbreak " * 5]
    checked = 0
    for _ in range(2000):
        memo = native.Memo(4096, 1 << 20, 32)
        items = [r.choice(pool) + str(r.randrange(3)) for _ in range(r.randrange(1, 8))]
        doc = {f"key {i}" if r.random() < 0.5 else "x" * 40 + str(i): v
               for i, v in enumerate(items)}
        ascii_only = r.random() < 0.5 or any("\ud800" in v for v in items)
        body = json.dumps(doc, ensure_ascii=ascii_only).encode()

        def sent(string: str) -> bytes:  # (a string as the body spells it)
            return json.dumps(string, ensure_ascii=ascii_only).encode()[1:-1]  # noqa: B023

        text, cuts, fresh, named = memo.read(body, 1)
        assert text == native.texts(body) and not cuts and not named
        kept = set()
        for start, end, raw_start, raw_end in fresh:
            assert sent(text[start:end]) == body[raw_start:raw_end]
            if r.random() < 0.5:
                memo.remember(body, raw_start, raw_end, 1, True)
                kept.add(body[raw_start:raw_end])
        strings = jsondoc_module.texts(json.loads(body, object_pairs_hook=tuple))
        assert len(fresh) == sum(len(sent(s)) >= 32 for s in strings)
        if memo.size()[0] != len(kept):
            continue  # (two strings in one slot: the second took the first's place)
        checked += 1
        text2, cuts2, _, named2 = memo.read(body, 1)
        expected = [s for s in strings if sent(s) not in kept]
        assert text2 == "\n".join(expected), (body, kept)
        assert len(cuts2) == len(strings) - len(expected) and named2 == bool(kept)
        assert cuts2 == sorted(cuts2) and all(0 <= c <= len(text2) for c in cuts2)
        assert memo.read(body, 2)[0] == text  # (another tag: nothing left out)
    assert checked > 1900


def test_a_string_whose_window_reaches_past_its_end_is_not_remembered() -> None:
    """A long string ending in a private key's header holds nothing alone, but its
    anchor's window reaches past its end: it is not remembered, so when the key's body
    follows it in a later turn, the two are read together and the key is found."""
    header, _, rest = PEM.partition("\n")
    scanner = Scanner(DETECTORS, b"salt", history=History())
    head = "x = 1\n" * 60 + CALL + "\n" + header
    assert not scanner.scan_body(json.dumps([head]).encode(), JSON, sandbox="s").findings
    assert scanner.history is not None and scanner.history.size() == (0, 0)
    body = json.dumps([head, rest]).encode()
    assert [f.detector for f in scanner.scan_body(body, JSON, sandbox="s").findings] \
        == ["private-key"]


def test_a_body_the_name_rules_find_something_in_remembers_nothing() -> None:
    """The name rules' pass over the document's text comes after the first reading: a
    body it finds a pair in remembers none of its strings (nothing was found in the
    strings alone), as any body with a finding."""
    scanner = Scanner(DETECTORS, b"salt", history=History())
    body = json.dumps({"notes": "r = 1\n" * 60 + CALL,
                       "aws_secret_access_key": AWS_SECRET}).encode()
    assert [f.detector for f in scanner.scan_body(body, JSON, sandbox="s").findings] \
        == ["aws"]
    assert scanner.history is not None and scanner.history.size() == (0, 0)
    clean = json.dumps({"notes": "r = 1\n" * 60 + CALL, "region": "eu"}).encode()
    assert not scanner.scan_body(clean, JSON, sandbox="s").findings
    assert scanner.history.size()[0] == 1


def test_a_body_of_many_strings_and_windows_costs_no_square() -> None:
    """What is remembered is decided in time of the strings and windows (times a
    logarithm): a body of 1,200 long strings, each with anchors that match nothing (a
    window each: 10,800), costs about what its scan without a history costs."""
    import time

    strings = [f"{i:05d} {'y' * 60} " + "ESCAPE SHAPE APE " * 3 + "z = 1; " * 50 + CALL
               for i in range(1200)]  # (Twilio's `AP` window reaches 300 characters on)
    body = json.dumps(strings).encode()
    assert len(body) < 1 << 20
    plain = Scanner(DETECTORS, b"salt")
    remembering = Scanner(DETECTORS, b"salt", history=History(slots=1 << 16, limit=8 << 20))

    def timed(scanner: Scanner, sandbox: str | None) -> float:
        started = time.perf_counter()
        assert not scanner.scan_body(body, JSON, sandbox=sandbox).findings
        return time.perf_counter() - started

    alone = min(timed(plain, None) for _ in range(3))
    first = timed(remembering, "s")
    assert remembering.history is not None and remembering.history.size()[0] > 1000
    assert first < 3 * alone + 0.2, (first, alone)


ESCAPES = ['\\"', "\\\\", '\\\\\\"', "\\\\\\\\", "\\u0022", "\\/", "\\n", "\\ud83d\\ude00"]


@pytest.mark.parametrize("escape", ESCAPES)
def test_a_remembered_string_is_found_whole_whatever_escape_lies_on_a_block_edge(
        escape: str) -> None:
    """`Memo.read` skims a long string for its end 64 bytes at a time before it reads it
    (one remembered is never read): an escape at every offset about the blocks' edges
    (a backslash last in a block escaping the next block's quote, runs of backslashes
    across an edge) ends the string where a JSON reader ends it; the string remembered
    is left out, and one differing only after the escape is read whole."""
    native = jsondoc_module.native()
    for at in range(0, 200):
        memo = native.Memo(64, 1 << 20, 32)
        sent = "a" * at + escape + "b" * 40  # (as the body spells it)
        body = f'["{sent}", "{sent}x", "{sent[:-1]}"]'.encode()
        strings = json.loads(body)
        text, cuts, fresh, _ = memo.read(body, 1)
        assert text == "\n".join(strings) and not cuts and len(fresh) == 3
        start, end, raw_start, raw_end = fresh[0]
        assert body[raw_start:raw_end] == sent.encode() and text[start:end] == strings[0]
        memo.remember(body, raw_start, raw_end, 1, False)
        text, cuts, _, _ = memo.read(body, 1)
        assert text == "\n".join(strings[1:]) and cuts == [0], at
        for cut in range(len(body) - 8, len(body)):  # (a body that ends early: declined)
            assert memo.read(body[:cut], 1) is None
