"""SecretValue: masked everywhere, constant-time compares, no pickling, leak variants."""

from __future__ import annotations

import base64
import copy
import logging
import pickle
from urllib.parse import quote, quote_plus

import pytest

from gateway.services.secrets import SecretValue

RAW = "sk-proj-Ab3/+x=y z&ü-0123456789abcdef"


def test_masked_in_repr_str_format_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    s = SecretValue(RAW)
    rendered = [repr(s), str(s), f"{s}", f"{s!r}", f"{s:>40}", "%s" % s, "{}".format(s)]  # noqa: UP031, UP032
    rendered += [repr([s]), repr({"k": s}), str((s,))]
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("t").warning("value %s %r", s, s)
    rendered += [caplog.text]
    for text in rendered:
        assert RAW not in text
        assert "****" in text
    assert repr(s) == "SecretValue('****')"


def test_reveal_and_len() -> None:
    s = SecretValue(RAW)
    assert s.reveal() == RAW
    assert len(s) == len(RAW)
    assert bool(s)


def test_equals_is_exact() -> None:
    s = SecretValue(RAW)
    assert s.equals(RAW)
    assert s.equals(RAW.encode())
    assert not s.equals(RAW + "x")
    assert not s.equals(RAW[:-1])
    assert not s.equals("")
    assert not s.equals(123)  # type: ignore[arg-type]


def test_eq_between_secret_values_only() -> None:
    a, b, c = SecretValue(RAW), SecretValue(RAW), SecretValue("other-value")
    assert a == b
    assert a != c
    assert (a != b) is False
    assert a != RAW  # never equal to a plain str: use equals() deliberately
    assert (a == RAW) is False


def test_unhashable() -> None:
    with pytest.raises(TypeError):
        hash(SecretValue(RAW))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_not_picklable(protocol: int) -> None:
    with pytest.raises(TypeError, match="cannot be pickled") as info:
        pickle.dumps(SecretValue(RAW), protocol=protocol)
    assert RAW not in str(info.value)


def test_copy_returns_same_immutable_object() -> None:
    s = SecretValue(RAW)
    assert copy.copy(s) is s
    assert copy.deepcopy({"a": s})["a"] is s
    with pytest.raises(AttributeError):
        s._value = "x"
    with pytest.raises(AttributeError):
        del s._value


def test_rejects_empty_and_non_str() -> None:
    with pytest.raises(ValueError, match="empty"):
        SecretValue("")
    with pytest.raises(TypeError):
        SecretValue(b"bytes")  # type: ignore[arg-type]


def test_variants_cover_the_encodings() -> None:
    s = SecretValue(RAW)
    raw = RAW.encode()
    expected = {
        raw,
        base64.b64encode(raw),
        base64.b64encode(raw).rstrip(b"="),
        base64.urlsafe_b64encode(raw),
        base64.urlsafe_b64encode(raw).rstrip(b"="),
        quote(RAW, safe="").encode(),
        quote(RAW).encode(),
        quote_plus(RAW).encode(),
    }
    variants = s.variants()
    assert expected <= set(variants)
    assert variants[0] == raw
    assert len(variants) == len(set(variants))
    assert s.variants() is variants  # computed once


@pytest.mark.parametrize("prefix", ["", "u:", "ab:", "user:", "x" * 7])
def test_variants_find_secret_inside_larger_base64(prefix: str) -> None:
    """Basic auth of "user:<key>" hides the key at any alignment; a fragment still matches."""
    s = SecretValue("sk-" + "A1b2C3d4" * 4)
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        blob = encode((prefix + s.reveal() + ":tail").encode())
        assert any(v in blob for v in s.variants()), prefix


def test_variants_of_short_secret_have_no_tiny_fragments() -> None:
    s = SecretValue("abcd")
    assert all(len(v) >= 4 for v in s.variants())
