"""The scan of one request: every part a receiver reads, decoded as it reads it.

Views of a request (each a text and its `Location`):

* the request line (also with %XX undone), the query parameters (decoded), each header
  by name, and the names themselves (a key sent as a header or field name);
* the body, content codings undone (bounded by the hold limit), then by Content-Type:
  JSON strings by JSON path (escapes undone, every value of a repeated key), form fields
  by name, multipart parts and gRPC messages each as a body, anything else as text as
  it is and with JSON's escapes undone (JSON as JSON whatever its type says);
* inside any view, base64 and hex runs decoded (`depth` times at most), and JSON in a
  string read one level in, then the next (`prefilter.nested_json`).

A JSON or form body is also read whole for the rules reading a value by its name (a
value found twice is reported once). Most bodies stop at the gate's one pass (`clean`).
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import accumulate, chain
from urllib.parse import parse_qsl, unquote_plus

from gateway.core.dlp import jsondoc
from gateway.core.dlp.archive_views import Sharing, archive_views, packed, run_views, unpacks
from gateway.core.dlp.clean import CleanBodies
from gateway.core.dlp.decoding import (
    Run,
    Unreadable,
    body_kind,
    decode_content,
    has_run,
    json_codec,
    text_codec,
)
from gateway.core.dlp.detector import Detector
from gateway.core.dlp.fastscan import HYPERSCAN, key_run
from gateway.core.dlp.findings import Finding, Hit, Location, ScanResult, findings_of
from gateway.core.dlp.heads import CleanParts
from gateway.core.dlp.history import History
from gateway.core.dlp.message_views import message_views
from gateway.core.dlp.multipart import views as multipart_views
from gateway.core.dlp.prefilter import (
    JSON_ESCAPE,
    Prefilter,
    holds_json_escape,
    json_unescape,
    nested_json,
    unescape,
)
from gateway.core.dlp.run_reading import RunReader
from gateway.core.framing import is_framed

__all__ = ["DEFAULT_LIMIT", "Hit", "Scanner"]

# The most decoded bytes a held body may have (the caller passes its own: the engines
# hold 1 MiB of an ordinary request body, 32 MiB where a check needs it whole).
DEFAULT_LIMIT = 1024 * 1024
_QUOTE = re.compile(r'(?<!\\)"')  # a quote that ends a JSON string


class Scanner:
    """Finds credentials with some detectors; `salt` keys the fingerprints."""

    def __init__(self, detectors: Iterable[Detector], salt: bytes, *,
                 limit: int = DEFAULT_LIMIT, depth: int = 2, fast: bool = HYPERSCAN,
                 history: History | None = None) -> None:
        self.detectors = tuple(detectors)
        self.salt = salt
        self.limit = limit
        self.depth = depth
        self.fast = fast  # the prefilter on Hyperscan (else the automaton: see fastscan)
        self.prefilter = Prefilter(self.detectors, fast=fast)
        self.context = Prefilter(tuple(
            Detector(d.name, tuple(r for r in d.rules if r.context or not r.anchors))
            for d in self.detectors), fast=fast)
        self.reach = max((d.reach for d in self.detectors), default=0)
        self.string_anchors = self.context.string_anchors()
        self._subsets: dict[frozenset[str], Scanner] = {}
        self._by_id: dict[int, tuple[Iterable[str], Scanner]] = {}
        # The parts of heads found clean (`heads.CleanParts`): `unclean_fields`.
        self.heads = CleanParts(self.prefilter.candidate, self._holding)
        self.unclean_fields = self.heads.unclean
        # Whether a whole body holds no candidate (`clean.CleanBodies`: one gate pass).
        self.body_clean = CleanBodies(self.prefilter).clean
        # The base64 and hex runs a detector may find something in, decoded.
        self.runs = RunReader(self.prefilter)
        # The long strings each sandbox sent that held nothing (`history`: one store for
        # the scanner and its selections; none where a rule reads without anchors).
        self._shared = history if history is not None else History()
        self.history = None if self.prefilter.unanchored else self._shared
        self.selection = frozenset(d.name for d in self.detectors)

    def only(self, names: Iterable[str]) -> Scanner:
        """A scanner with the named detectors of this one (a policy's selection), built
        once per selection (an automaton each; policies name few selections). Looked up
        by the identity of `names` first: a policy's tuple is the same every request."""
        known = self._by_id.get(id(names))
        if known is not None and known[0] is names:
            return known[1]
        wanted = frozenset(names)
        found = self._subsets.get(wanted)
        if found is None:
            found = Scanner([d for d in self.detectors if d.name in wanted], self.salt,
                            limit=self.limit, depth=self.depth, fast=self.fast,
                            history=self._shared)
            if len(self._subsets) < 64:
                self._subsets[wanted] = found
        if len(self._by_id) < 256:  # (holding `names`, so its id is not reused)
            self._by_id[id(names)] = (names, found)
        return found

    def findings(self, hits: Iterable[Hit]) -> tuple[Finding, ...]:
        """Findings of hits, fingerprinted with this scanner's salt (`findings_of`)."""
        return findings_of(hits, self.salt)

    def scan_request(self, method: str, target: str, headers: Iterable[tuple[str, str]],
                     body: bytes = b"") -> ScanResult:
        """The whole request: line, headers, body (by its Content-Type and -Encoding)."""
        headers, hits = list(headers), list[Hit]()
        ctype = next((v for k, v in headers if k.lower() == "content-type"), None)
        coding = ", ".join(v for k, v in headers if k.lower() == "content-encoding") or None
        try:
            with Sharing(len(body) + len(target) + sum(map(len, chain(*headers)))):
                hits += self.head_hits(method, target, headers)
                hits += self.body_hits(body, ctype, coding)
        except Unreadable as exc:
            return ScanResult(self.findings(hits), str(exc))
        return ScanResult(self.findings(hits))

    def scan_body(self, body: bytes, content_type: str | None = None,
                  content_encoding: str | None = None, *, gated: bool = False,
                  sandbox: str | None = None) -> ScanResult:
        """`gated`: `body_clean` said no already; `sandbox`: whose body it is (what it
        sent before and held nothing is not read again: `history`)."""
        try:
            return ScanResult(self.findings(self.body_hits(body, content_type,
                                                           content_encoding, gated, sandbox)))
        except Unreadable as exc:
            return ScanResult((), str(exc))

    def scan_text(self, text: str, location: Location) -> tuple[Finding, ...]:
        return self.findings(self.text_hits(text, location))

    # -- views -----------------------------------------------------------------------------

    def text_hits(self, text: str, location: Location, depth: int = 0) -> Iterator[Hit]:
        """One view: detectors around anchors, then decoded base64/hex runs."""
        if text:
            yield from self.parts_hits([(text, location)], depth)

    def parts_hits(self, parts: Sequence[tuple[str, Location | str]], depth: int = 0,
                   base: Location | None = None, anchors: set[str] | None = None,
                   nested: bool = False) -> Iterator[Hit]:
        """Many views scanned as one text (joined by newlines, which no value crosses:
        a value is cut at its view's end): one prefilter pass for all the strings of a
        JSON document instead of one per string. A view's place may be a name under
        `base` (a JSON path), made a `Location` only where something is found;
        `anchors`: the anchors found are added to it (before the first hit is yielded)."""
        text = "\n".join(t for t, _ in parts)
        starts = list(accumulate((len(t) + 1 for t, _ in parts[:-1]), initial=0))

        def locate(offset: int) -> tuple[Location, int, int]:
            i = bisect_right(starts, offset) - 1
            where = parts[i][1]
            if isinstance(where, str):
                assert base is not None
                where = Location(base.part, where, None, base.via)
            return where, starts[i], starts[i] + len(parts[i][0])

        for span in self.prefilter.spans(text, anchors):
            where, start, end = locate(span.start)
            yield Hit(span.detector, _at(where, span.start - start),
                      text[span.start:min(span.end, end)])
        if depth < self.depth:
            for run, inner in self.decoded(text, starts):
                where, start, _ = locate(run.start)
                offset = None if where.offset is None else where.offset + run.start - start
                yield from self.run_hits(inner, where.under(run.kind, offset), depth + 1)
        if nested or not holds_json_escape(text):  # (memchr: most texts)
            return
        # JSON inside a view (a tool call's arguments, a header's value, a decoded run):
        # read as the reader parsing it reads it, each level its own text at its place.
        for part, place in parts:
            for level in nested_json(part):
                yield from self.parts_hits([(level, place)], depth, base, anchors, True)

    def decoded(self, text: str, joins: Sequence[int] = ()) -> Iterator[tuple[Run, str]]:
        """The runs of `text` a detector may find something in (`RunReader.decoded`)."""
        return self.runs.decoded(text, joins)

    def run_hits(self, inner: str, where: Location, depth: int) -> Iterator[Hit]:
        """A decoded run's text: as text, and unpacked where it is a compressed file."""
        if packed(inner, where):
            yield from run_views(self, inner, where)
        yield from self.text_hits(inner, where, depth)

    def head_hits(self, method: str, target: str,
                  headers: Iterable[tuple[str, str]]) -> Iterator[Hit]:
        """The request line (raw and unescaped), query parameters, each header, read as
        one text (`parts_hits`)."""
        headers = list(headers)
        line = f"{method} {target}"
        plain = unescape(line)
        _, _, query = target.partition("?")
        parts: list[tuple[str, Location]] = []
        if query:  # parameters first: their name is the better location
            for name, value in parse_qsl(query, keep_blank_values=True, encoding="latin-1"):
                parts += ((value, Location("query", name[:80])),
                          (name, Location("query", name[:80])))
        parts.append((line, Location("request line")))
        if plain != line:
            parts.append((plain, Location("request line", via=("percent",))))
        for name, value in headers:
            parts += ((value, Location("header", name)),
                      (name, Location("header", "name")))  # (shown hidden)
        # One text for all (`parts_hits`: no value crosses the newlines joining them):
        # a head of thirty fields is one prefilter pass and one run search, not sixty.
        yield from self.parts_hits([part for part in parts if part[0]])

    def body_hits(self, body: bytes, content_type: str | None,
                  content_encoding: str | None, gated: bool = False,
                  sandbox: str | None = None) -> list[Hit]:
        """The body's views; raises `Unreadable` if it cannot be decoded."""
        if content_encoding:
            body = decode_content(body, content_encoding, self.limit)
        elif len(body) > self.limit:
            raise Unreadable(f"the body is more than {self.limit} bytes")
        with Sharing(len(body)):  # (the runs' compressed files: one bound)
            return list(self.body_views(body, content_type or "", Location("body", offset=0),
                                        content_encoding, gated and not content_encoding,
                                        sandbox))

    def head_clean(self, method: str, target: str,
                   fields: Iterable[tuple[bytes, bytes]]) -> bool:
        """Whether a head holds no candidate (`heads.CleanParts.unclean`)."""
        return self.heads.unclean(method, target, list(fields)) is None

    def _holds(self, part: bytes | bytearray) -> bool:
        """Whether `parts_hits` may find anything in one part of a head alone: the gate,
        then an anchor, or a run decoding to a text that holds one or a run (a W3C
        trace id is hex of 16 random bytes: read, and clean)."""
        if not self.prefilter.candidate(part):
            return False
        text = part.decode("latin-1")
        if self.prefilter.any(text) or next(nested_json(text), None) is not None:
            return True  # (an anchor, or JSON escapes: the scan reads its JSON)
        return self.depth > 0 and next(self.decoded(text), None) is not None

    def _holding(self, parts: list[bytes], joined: bytes) -> list[bytes]:
        """The parts (of a head, `joined` by newlines) that `_holds`: where none holds
        an anchor (one search for all), a part holds something only by a run's text."""
        if self.prefilter.any(joined) or JSON_ESCAPE.search(joined) is not None:
            return [p for p in parts if self._holds(p)]
        if self.depth == 0 or (not self.prefilter.unanchored  # (every part's runs: one
                               and self.prefilter.gate.runs_clean(joined)):  # C call)
            return []
        return [p for p in parts if key_run(p) and
                next(self.decoded(p.decode("latin-1")), None) is not None]

    def body_views(self, body: bytes, ctype: str, where: Location, coding: str | None = None,
              gated: bool = False, sandbox: str | None = None, nested: int = 0
              ) -> Iterator[Hit]:
        if not body:
            return
        if coding:
            where = Location(where.part, where.name, where.offset,
                             (*where.via, *(c.strip() for c in coding.split(",") if c.strip())))
        if unpacks(body, where):  # (a .tar.gz, a .zip, an image that is one too: its files)
            yield from archive_views(self, body, where, nested)
        if not gated and self.body_clean(body, ctype):
            # Most bodies: no anchor, no base64 run and no escape its reader undoes that
            # could hide one: one C pass on the bytes as they are, no text made of them.
            return
        lowered = ctype.lower()  # (`ctype` as sent: a multipart boundary keeps its case)
        if "multipart/" in lowered:
            yield from multipart_views(self, body, ctype, where, nested)
            return
        if is_framed(lowered):  # (its messages: a compressed one decompressed, a git
            yield from message_views(self, body, lowered, where, nested)  # object inflated)
            return
        kind = body_kind(body, lowered)
        if kind == "form" and body_kind(body, "") == "json":  # (a JSON document sent as a
            # form: a receiver reading JSON whatever the type says undoes its escapes)
            yield from self.body_views(body, "application/json", where, None, False, sandbox,
                                       nested)
        codec = json_codec(body) if kind == "json" else text_codec(body, lowered)
        # (a JSON body in latin-1: its text is made only where a reading needs it, the
        # rules reading a name beside its value, `_context`; its strings are read in C)
        text = "" if kind == "json" and codec == "latin-1" else body.decode(codec, "replace")
        # (latin-1: the text's bytes are the body's, not made again for the C check)
        if kind != "text" and not key_run(body if codec == "latin-1" else text):
            text = text or body.decode(codec, "replace")
            # The gate: what a JSON or form reader reads holds no anchor and no run. (A
            # text whose bytes as sent hold a run a decoder reads is read on without this
            # view: going on is always right, only skipping must be, and such a text,
            # an agent's chat with a tool call id, is nearly always read on anyway.)
            plain = unescape(text)  # (one holding JSON escapes still: JSON in a string)
            if not has_run(plain) and not self.prefilter.any(plain) and \
                    not holds_json_escape(plain):  # (the C check first)
                return
        form = kind == "form"
        if kind == "json":
            seen: set[str] = set()  # (the anchors in its strings)
            later: list[Callable[[], None]] = []  # (`history`: what it then remembers)
            holds = None if sandbox is None or self.history is None else \
                self.history.first(self, body, sandbox, seen, later)
            strings = None if holds is not None else jsondoc.joined(body)
            if holds is not None or strings is not None:
                # Read as one text first (what `parts_hits` joins them into, made in C):
                # only where that finds something are they read by their JSON paths.
                if strings is not None:
                    holds = bool(strings) and next(self.parts_hits(
                        [(strings, where)], anchors=seen), None) is not None
                if holds:
                    document = jsondoc.load(body)
                    # (json refusing what the C reading took, a stack too deep for it:
                    # the strings read again without their paths, never dropped)
                    yield from self.parts_hits([(jsondoc.joined(body) or "", where)]) \
                        if document is jsondoc.NOT_JSON else self.parts_hits(
                            jsondoc.strings(document, f"{where.name} $" if where.name
                                            else "$"), base=where)
                # The rules reading a name beside its value: on the text with its
                # escapes undone (`"\\u0061ws_secret_access_key"` is `aws_...`), where
                # the strings hold such a rule's anchor (`Prefilter.string_anchors`).
                named = self.string_anchors
                pairs = [] if named is not None and seen.isdisjoint(named) else \
                    list(self._context(json_unescape(text or body.decode(codec, "replace")),
                                       where, json_text=True))
                yield from pairs
                for keep in () if pairs else later:
                    keep()
                return
        if form:
            yield from self._form(text, where)
            return
        # Anything else: as it is (%XX is a file's), JSON's escapes undone (a lax reader's).
        text = text or body.decode(codec, "replace")
        for view in dict.fromkeys((text, json_unescape(text))):  # (the same text once)
            yield from self.text_hits(view, where)

    def _form(self, text: str, where: Location) -> Iterator[Hit]:
        """A form's fields by name, and its text whole (the rules reading a name)."""
        for name, value in parse_qsl(text, keep_blank_values=True, encoding="latin-1"):
            field = Location(where.part, _named(where, f"form field {name[:80]}"), None, where.via)
            yield from self.text_hits(value, field)
            yield from self.text_hits(name, field)
        yield from self._context(unquote_plus(text, encoding="latin-1"), where)

    def _context(self, text: str, where: Location, *, json_text: bool = False) -> Iterator[Hit]:
        """A document's text whole, for the rules reading a name beside its value."""
        for span in self.context.spans(text):
            value = text[span.start:span.end]
            if json_text:
                if _QUOTE.search(value):  # (a value never spans two JSON strings)
                    continue
                value = jsondoc.json_text(value)
            yield Hit(span.detector, _at(where, span.start), value)


def _at(where: Location, offset: int) -> Location:
    """A location `offset` characters into a view (only a view with an offset and no
    name counts offsets: a JSON path or a header name says where already)."""
    if where.offset is None or where.name:
        return where
    return Location(where.part, where.name, where.offset + offset, where.via)


def _named(where: Location, name: str) -> str:
    return f"{where.name} {name}" if where.name else name

