"""Headers (gateway/core/messages.py): case-insensitive lookups over an index kept right
through every change."""

from __future__ import annotations

from gateway.core.messages import Headers


def test_lookups_ignore_case_and_keep_order_and_repeats() -> None:
    h = Headers.of(("Host", "a"), ("X-A", "1"), ("x-a", "2"), ("B", "3"))
    assert (h.get("HOST"), h.get_all("X-a"), h.count("x-A"), "b" in h) == ("a", ["1", "2"], 2,
                                                                          True)
    assert h.get("missing") is None and h.get_all("missing") == [] and "missing" not in h


def test_the_index_follows_every_change() -> None:
    h = Headers.of(("Host", "a"), ("X-A", "1"), ("x-a", "2"), ("B", "3"))
    assert h.get("b") == "3"  # (index built)
    h.set("X-New", "n")  # appended
    assert h.get("x-new") == "n" and h.fields[-1] == (b"X-New", b"n")
    h.set("host", "z")  # replaced in place, the name's case as sent
    assert h.get("HOST") == "z" and h.fields[0] == (b"Host", b"z")
    h.set("x-a", "9")  # repeated: one left, at the first one's place
    assert h.get_all("X-A") == ["9"] and h.get("b") == "3" and h.get("x-new") == "n"
    assert h.remove("b") and not h.remove("b")
    assert h.get("b") is None and h.get("x-new") == "n"
    h.fields = [(b"Only", b"1")]  # replaced whole
    assert h.get("only") == "1" and h.get("host") is None


def test_a_held_fields_list_is_never_changed_under_its_holder() -> None:
    h = Headers.of(("A", "1"))
    held = h.fields
    h.set("A", "2")
    h.set("B", "3")
    assert held == [(b"A", b"1")]


def test_without_drops_every_named_field_whatever_its_case() -> None:
    h = Headers([(b"Host", b"a"), (b"Connection", b"x-a"), (b"X-A", b"1"), (b"x-a", b"2"),
                 (b"Keep", b"k")])
    assert h.without({b"connection", b"x-a"}) == [(b"Host", b"a"), (b"Keep", b"k")]
    assert h.without({b"nothing"}) == h.fields and h.without(()) is not h.fields
    h.remove("host")  # (the index follows)
    assert h.without({b"keep"}) == [(b"Connection", b"x-a"), (b"X-A", b"1"), (b"x-a", b"2")]


def test_removals_leave_the_index_as_a_fresh_one_would_be() -> None:
    """`remove` keeps the index by moving positions instead of building it again: after
    any sequence of removals (a name once, repeated, first, last, in the middle, any case)
    every lookup answers what a Headers made from the remaining fields answers."""
    names = ["Host", "X-A", "x-a", "B", "Connection", "X-A", "C", "b", "Host"]
    for order in range(len(names) * 3):
        h = Headers((n.encode(), str(i).encode()) for i, n in enumerate(names))
        h.get("host")  # (the index built, then kept through the removals)
        gone = [names[(order + k * 5) % len(names)] for k in range(1 + order % 4)]
        for name in gone:
            h.remove(name.upper() if order % 2 else name)
            fresh = Headers(h.fields)
            for lookup in {*(n.lower() for n in names), "missing"}:
                assert (h.get_all(lookup), h.count(lookup)) == \
                    (fresh.get_all(lookup), fresh.count(lookup)), (gone, lookup)
            assert h.without({b"x-a", b"c"}) == fresh.without({b"x-a", b"c"})


def test_a_list_fields_lines_are_read_as_one_list() -> None:
    """RFC 9110 5.3: `Content-Encoding: identity` and `Content-Encoding: gzip` are the list
    `identity, gzip`, which a receiver undoes whole (the gateway read the first line)."""
    h = Headers.of(("Content-Encoding", "identity"), ("X-A", "1"), ("content-encoding", "gzip"))
    assert h.joined("Content-Encoding") == "identity, gzip" and h.get("content-encoding") == \
        "identity"
    assert Headers.of(("Content-Encoding", "br")).joined("content-encoding") == "br"
    assert h.joined("missing") is None
