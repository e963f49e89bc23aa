"""`lazy_names`: a package's names imported on first use (PEP 562), on a package built in
tmp_path, so what is imported when is seen in `sys.modules`. That the real facades keep
the heavy modules out of a gateway process: `tests/integration/test_optional_imports.py`."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import gateway.services.policy
import gateway.services.secrets
from gateway.lazy import lazy_names

PACKAGE = "lazy_probe_pkg"
INIT = """
from gateway.lazy import lazy_names

__getattr__ = lazy_names(__name__, {"Heavy": "heavy", "missing": "heavy"}, globals())
"""


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    root = tmp_path / PACKAGE
    root.mkdir()
    (root / "__init__.py").write_text(INIT)
    (root / "heavy.py").write_text("class Heavy:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield PACKAGE
    for name in [n for n in sys.modules if n == PACKAGE or n.startswith(f"{PACKAGE}.")]:
        del sys.modules[name]


def test_a_name_is_imported_on_first_use_and_kept(package: str) -> None:
    pkg = importlib.import_module(package)
    assert f"{package}.heavy" not in sys.modules
    assert "Heavy" not in vars(pkg)
    heavy = pkg.Heavy
    assert f"{package}.heavy" in sys.modules
    assert heavy is sys.modules[f"{package}.heavy"].Heavy
    assert vars(pkg)["Heavy"] is heavy  # kept: the next use does not call __getattr__
    from lazy_probe_pkg import Heavy
    assert Heavy is heavy


def test_an_unknown_name_is_an_attribute_error_naming_the_package(package: str) -> None:
    pkg = importlib.import_module(package)
    with pytest.raises(AttributeError, match=r"^module 'lazy_probe_pkg' has no attribute "
                                             r"'Nope'$"):
        _ = pkg.Nope
    assert not hasattr(pkg, "Nope")
    assert f"{package}.heavy" not in sys.modules  # nothing imported for it


def test_a_name_its_module_lacks_is_an_attribute_error(package: str) -> None:
    pkg = importlib.import_module(package)
    with pytest.raises(AttributeError, match="missing"):
        _ = pkg.missing
    assert "missing" not in vars(pkg)


def test_the_returned_function_works_on_any_namespace() -> None:
    namespace: dict[str, object] = {}
    getter = lazy_names("gateway.services.policy", {"PolicyError": "loader"}, namespace)
    from gateway.services.policy.loader import PolicyError
    assert getter("PolicyError") is PolicyError
    assert namespace == {"PolicyError": PolicyError}


@pytest.mark.parametrize("facade", [gateway.services.policy, gateway.services.secrets])
def test_every_lazy_name_of_the_real_facades_resolves(facade: object) -> None:
    exported = vars(facade)["__all__"]
    assert all(getattr(facade, name) is not None for name in exported)
