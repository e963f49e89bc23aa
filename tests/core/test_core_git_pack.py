"""A git push's body (`core/git_pack.py`) as git's server reads it: real pushes made by
git (a whole pack, a thin pack of deltas, sha256 objects, push options) read at any cut,
every object inflated and a delta's inserted bytes given; what is not git's, cut short,
or inflates past its size or the push's bound is an EncodingError."""

from __future__ import annotations

import os
import subprocess
import zlib
from pathlib import Path

import pytest

from gateway.core import git_pack
from gateway.core.encodings import EncodingError
from gateway.core.git_pack import PackReader, is_git_push, is_push_path

KEY = "ghp_bbI3N2G46G3G8hLwqoiCabcdefghij0123456789"
_ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t", "GIT_AUTHOR_DATE": "@0 +0000",
        "GIT_COMMITTER_DATE": "@0 +0000"}


def _pkt(line: bytes) -> bytes:
    return b"%04x" % (len(line) + 4) + line


def _git(work: Path, *args: str, data: bytes | None = None) -> bytes:
    env = {**os.environ, **_ENV, "HOME": str(work)}
    return subprocess.run(["git", *args], cwd=work, env=env, input=data, check=True,
                          capture_output=True, timeout=30).stdout


def _push(tmp: Path, fmt: str = "sha1", options: bool = False) -> tuple[bytes, bytes]:
    """A push of a second commit (a 3,000-line file with one line changed to hold KEY,
    and a new small file) as git sends it: the ref update, then the thin pack git's
    `send-pack` makes (the changed file a delta of the one the server has); and the
    whole pack of both commits (every object whole or a delta of one in the pack)."""
    work = tmp / fmt
    work.mkdir()
    _git(work, "init", "-q", "-b", "main", f"--object-format={fmt}")
    lines = [f"line {i} of the generated file {i * 7919 % 10007}" for i in range(3000)]
    (work / "big.txt").write_text("\n".join(lines) + "\n")
    _git(work, "add", ".")
    _git(work, "commit", "-q", "-m", "one")
    old = _git(work, "rev-parse", "HEAD").strip()
    lines[1500] = f"GITHUB_TOKEN={KEY}"
    (work / "big.txt").write_text("\n".join(lines) + "\n")
    (work / "small.txt").write_text("nothing to see\n")
    _git(work, "add", ".")
    _git(work, "commit", "-q", "-m", "two")
    new = _git(work, "rev-parse", "HEAD").strip()
    thin = _git(work, "pack-objects", "--stdout", "--thin", "--revs",
                data=new + b"\n^" + old + b"\n")
    whole = _git(work, "pack-objects", "--stdout", "--revs", data=new + b"\n")
    caps = b"report-status side-band-64k object-format=" + fmt.encode() + (
        b" push-options" if options else b"") + b" agent=git/2.39"
    head = _pkt(old + b" " + new + b" refs/heads/main\0" + caps + b"\n") + b"0000"
    if options:
        head += _pkt(b"ci.skip\n") + b"0000"
    return head + thin, head + whole


def _read(body: bytes, step: int) -> list[tuple[int, int, bytes]]:
    reader, out = PackReader(), []
    for at in range(0, len(body), step):
        out += reader.numbered(body[at:at + step])
        assert reader.pending < 300  # (a line being read, a header; a few in zlib)
    reader.end()
    return out


@pytest.mark.parametrize(("fmt", "options"), [("sha1", False), ("sha256", False),
                                              ("sha1", True)])
def test_a_real_push_is_read_object_by_object_at_any_cut(tmp_path: Path, fmt: str,
                                                          options: bool) -> None:
    thin, whole = _push(tmp_path, fmt, options)
    assert KEY.encode() not in thin and KEY.encode() not in whole  # (deflated)
    for body in (thin, whole):
        expected = _read(body, len(body))
        text = b"".join(piece for _, _, piece in expected)
        assert KEY.encode() in text and b"nothing to see" in text
        assert b"refs/heads/main" in b"".join(p for n, _, p in expected if n == 0)
        for step in (1, 3, 4096):
            got = _read(body, step)
            assert b"".join(p for _, _, p in got) == text, step
            assert [n for n, _, _ in got] == sorted(n for n, _, _ in got)


def test_a_delta_gives_its_inserted_bytes_not_its_base(tmp_path: Path) -> None:
    """The thin pack's changed file is a delta of the one the server has: what it gives
    is the line it inserts, not the 3,000 lines it copies."""
    thin, whole = _push(tmp_path)
    got = b"".join(p for _, _, p in _read(thin, len(thin)))
    assert KEY.encode() in got and len(got) < 2000 and b"line 10 of" not in got
    assert b"line 10 of" in b"".join(p for _, _, p in _read(whole, len(whole)))


def test_a_push_that_only_deletes_has_no_pack() -> None:
    body = _pkt(b"a" * 40 + b" " + b"0" * 40 + b" refs/heads/old\0report-status\n") + b"0000"
    assert [n for n, _, _ in _read(body, 1)] == [0]


def _pack(*objects: tuple[int, bytes], wrong_size: int = 0) -> bytes:
    """A pack of (kind, inflated bytes) objects, made here (kinds 1-4 whole, 6 a delta
    at an offset), with a zero trailer (git's is a checksum, which the reader skips)."""
    out = b"PACK\0\0\0\2" + len(objects).to_bytes(4, "big")
    for kind, data in objects:
        size = len(data) + wrong_size
        head = bytearray([kind << 4 | size & 0x0F])
        size >>= 4
        while size:
            head[-1] |= 0x80
            head.append(size & 0x7F)
            size >>= 7
        out += bytes(head) + (b"\x05" if kind == 6 else b"") + zlib.compress(data)
    return _pkt(b"0" * 40 + b" " + b"1" * 40 + b" refs/heads/x\0\n") + b"0000" + out + \
        b"\0" * 20


@pytest.mark.parametrize(("body", "says"), [
    (b"0032" + b"x" * 10, "ends inside"),  # (a line cut short)
    (b"+03a" + b"x" * 60, "lines are not git's"),
    (b"0003", "lines are not git's"),
    (b"0000NOPE" + b"\0" * 20, "not a git pack"),
    (_pack((3, b"blob"))[:-30], "ends inside"),
    (_pack((3, b"blob")) + b"x", "bytes after its pack"),
    (_pack((5, b"blob")), "no kind git has"),
    (_pack((3, b"blob"), wrong_size=1), "less than its size"),
    (_pack((3, b"blob"), wrong_size=-1), "more than its size"),
    (_pack((6, b"\x04\x04\x00")), "reserves"),  # (delta op 0)
    (_pack((6, b"\x04\x04\x03ab")), "less than its size"),  # (an insert cut short)
])
def test_what_is_not_a_readable_push_is_an_error(body: bytes, says: str) -> None:
    for step in (1, len(body)):
        with pytest.raises(EncodingError, match=says):
            _read(body, step)


def test_a_delta_at_an_offset_gives_its_inserts() -> None:
    delta = b"\x04\x0a" + b"\x90\x04" + b"\x06" + b"insert"  # (copy 4 from 0, insert 6)
    for step in (1, 1000):
        got: dict[int, bytes] = {}
        for n, _, piece in _read(_pack((3, b"base"), (6, delta)), step):
            got[n] = got.get(n, b"") + piece
        assert (got[1], got[2]) == (b"base", b"insert"), step


def test_a_push_that_inflates_past_its_bound_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A pack inflates to at most FLOOR + RATIO times its bytes (a zlib bomb of a blob
    is refused as it inflates, never held)."""
    monkeypatch.setattr(git_pack, "FLOOR", 1000)
    body = _pack((3, b"\0" * 1_000_000))
    assert len(body) < 2000
    with pytest.raises(EncodingError, match="more than 64 times"):
        _read(body, len(body))
    _read(_pack((3, b"x" * 900)), 7)


@pytest.mark.parametrize(("ctype", "push"), [
    ("application/x-git-receive-pack-request", True),
    ("Application/X-Git-Receive-Pack-Request; charset=x", True),
    ("application/x-git-upload-pack-request", False),  # (a fetch: no objects sent)
    ("application/octet-stream", False), (None, False)])
def test_which_bodies_are_pushes(ctype: str | None, push: bool) -> None:
    assert is_git_push(ctype) is push


@pytest.mark.parametrize(("target", "push"), [
    ("/o/r.git/git-receive-pack", True), ("/o/r/git-receive-pack?x=1", True),
    ("/o/r.git/git-receive-pack/", True), ("/o/r.git/git%2Dreceive%2Dpack", True),
    ("/o/r.git/GIT-RECEIVE-PACK", True), ("/o/r.git/git-upload-pack", False),
    ("/o/r.git/info/refs?service=git-receive-pack", False), ("/v1/chat", False)])
def test_gits_push_path_is_known_whatever_its_spelling(target: str, push: bool) -> None:
    """A body posted there is read as a push whatever its Content-Type says (a server
    routing by the path may read a pack so)."""
    assert is_push_path(target) is push
