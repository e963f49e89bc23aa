"""A RubyGems source on disk, as rubygems.org and index.rubygems.org serve it, for a
static server (nginx) to answer for both names: one gem built by the real `gem build`,
the full index written by the real `gem generate_index` (`specs.4.8.gz`, the
`quick/Marshal.4.8/*.gemspec.rz` specs, `gems/*.gem`), and the compact index that
`gem` (3.3: when a HEAD of index.rubygems.org's root answers 200) and Bundler read
first (`versions`, `info/<name>`)."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

GEMSPEC = """\
Gem::Specification.new do |s|
  s.name = {name!r}
  s.version = {version!r}
  s.summary = "sandbox-gateway preset test gem"
  s.authors = ["sandbox-gateway"]
  s.license = "MIT"
  s.files = ["lib/{name}.rb"]
end
"""


def _gem(*args: str, cwd: Path) -> None:
    out = subprocess.run(["gem", *args], cwd=cwd, capture_output=True, text=True,
                         timeout=120, check=False, env={"PATH": "/usr/bin:/bin",
                                                        "HOME": str(cwd)})
    assert out.returncode == 0, f"gem {' '.join(args)}: {out.stdout}{out.stderr}"


def make_gem_source(www: Path, work: Path, name: str, version: str, value: str) -> Path:
    """Write the source into `www`; the gem's `lib/<name>.rb` defines
    `<Name>::VALUE = value`. Returns the .gem file."""
    src = work / f"{name}-src"
    (src / "lib").mkdir(parents=True)
    (src / f"{name}.gemspec").write_text(GEMSPEC.format(name=name, version=version))
    (src / "lib" / f"{name}.rb").write_text(
        f"module {name.capitalize()}\n  VALUE = {value!r}\nend\n")
    _gem("build", f"{name}.gemspec", cwd=src)
    gem = www / "gems" / f"{name}-{version}.gem"
    gem.parent.mkdir(parents=True, exist_ok=True)
    gem.write_bytes((src / gem.name).read_bytes())
    _gem("generate_index", "--directory", str(www), cwd=work)
    info = f"---\n{version} |checksum:{hashlib.sha256(gem.read_bytes()).hexdigest()}\n"
    (www / "info").mkdir()
    (www / "info" / name).write_text(info)
    (www / "versions").write_text(
        "created_at: 2026-11-29T00:00:00Z\n---\n"
        f"{name} {version} {hashlib.md5(info.encode(), usedforsecurity=False).hexdigest()}\n")
    (www / "index.html").write_text("RubyGems\n")  # gem 3.3 HEADs the root: 200 = compact
    return gem
