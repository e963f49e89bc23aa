"""`FileStore`: secrets from a local YAML file (``name: value`` per line).

Meant for development and small installs. The file is refused if "others" may
read or write it (group access is allowed, for Kubernetes ``fsGroup``), and it
is re-read whenever its inode, size or mtime changes, so an edit, or the
symlink swap Kubernetes does when a mounted Secret changes, takes effect on the
next fetch without a restart.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import yaml

from gateway.core.secret_value import SecretValue
from gateway.services.secrets.base import (
    SecretNotFound,
    SecretStoreConfigError,
    SecretStoreError,
)

_TEMPLATE = """\
# sandbox-gateway secrets (store: file). One secret per line:
#   openai-api-key: "sk-..."
# Keep this file private: chmod 600 (group access is allowed, "others" is refused).
# For production, use the azure-keyvault store instead.
"""

_Signature = tuple[int, int, int, int]


def _fix_hint(path: Path) -> str:
    return (
        f"run `chmod 600 {path}` (on Kubernetes, mount the Secret with defaultMode: 0440 or 0400)"
    )


class FileStore:
    """Secrets read from a flat YAML map; reloaded when the file changes."""

    name = "file"

    def __init__(self, path: str | os.PathLike[str], *, create_if_missing: bool = False) -> None:
        self.path = Path(path)
        self._signature: _Signature | None = None
        self._values: dict[str, SecretValue] = {}
        if not self.path.exists():
            if not create_if_missing:
                raise SecretStoreConfigError(
                    f"secret file {self.path} does not exist; create it with `name: value` "
                    f"lines and `chmod 600 {self.path}`, or configure another secrets.store"
                )
            self._create()
        problem: str | None = None
        try:
            self._reload_if_changed()
        except SecretStoreError as exc:
            problem = str(exc)
        if problem is not None:
            raise SecretStoreConfigError(problem)

    def _create(self) -> None:
        """Create an empty, private file with a comment explaining the format."""
        if self.path.parent != Path():
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return
        except OSError as exc:
            raise SecretStoreConfigError(
                f"cannot create secret file {self.path}: {exc.strerror}"
            ) from None
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(_TEMPLATE)

    async def fetch(self, secret_name: str) -> SecretValue:
        """Return the value of ``secret_name``, re-reading the file if it changed."""
        self._reload_if_changed()
        value = self._values.get(secret_name)
        if value is None:
            raise SecretNotFound(
                secret_name,
                f'secret "{secret_name}" is not in the file store {self.path}; add it '
                f'as a line `{secret_name}: "<value>"`',
            )
        return value

    async def close(self) -> None:
        """Nothing to release; forget the loaded values."""
        self._values = {}
        self._signature = None

    def _reload_if_changed(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise SecretStoreError(
                f"cannot read secret file {self.path}: {exc.strerror}", transient=False
            ) from None
        signature = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if signature == self._signature:
            # Unchanged file; permissions can change without touching mtime.
            self._check_mode(st.st_mode)
            return
        try:
            with open(self.path, "rb") as f:
                opened = os.fstat(f.fileno())
                # Check the file we actually opened, not a name that may have moved.
                self._check_mode(opened.st_mode)
                data = f.read()
        except OSError as exc:
            raise SecretStoreError(
                f"cannot read secret file {self.path}: {exc.strerror}", transient=False
            ) from None
        self._values = self._parse(data)
        self._signature = (opened.st_dev, opened.st_ino, opened.st_size, opened.st_mtime_ns)

    def _check_mode(self, mode: int) -> None:
        if not stat.S_ISREG(mode):
            raise SecretStoreError(f"secret file {self.path} is not a regular file")
        if mode & 0o007:
            raise SecretStoreError(
                f"secret file {self.path} is accessible by other users (mode "
                f"{stat.S_IMODE(mode):04o}); refusing to use it: {_fix_hint(self.path)}"
            )

    def _parse(self, data: bytes) -> dict[str, SecretValue]:
        """Parse the YAML map; errors cite line numbers only, never file content."""
        # A YAML error's own text quotes a snippet of the file, so it is neither
        # shown nor chained: the new error is raised outside the except block.
        where: str | None = None
        try:
            loaded = yaml.safe_load(data)
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        except (yaml.YAMLError, UnicodeDecodeError):
            where = " (or not UTF-8)"
        if where is not None:
            raise SecretStoreError(
                f"secret file {self.path} is not valid YAML{where}; "
                'expected lines like `name: "value"`'
            )
        if loaded is None:
            return {}
        if not isinstance(loaded, dict):
            raise SecretStoreError(
                f"secret file {self.path} must be a map of `name: value` lines, "
                f"not a {type(loaded).__name__}"
            )
        values: dict[str, SecretValue] = {}
        for key, raw in loaded.items():
            if not isinstance(key, str) or not key:
                raise SecretStoreError(
                    f"secret file {self.path}: every secret name must be a non-empty string"
                )
            if not isinstance(raw, str):
                kind = "empty" if raw is None else f"a {type(raw).__name__}, not a string"
                raise SecretStoreError(
                    f'secret file {self.path}: the value of "{key}" is {kind}; '
                    "write it as a quoted string"
                )
            if not raw:
                raise SecretStoreError(f'secret file {self.path}: the value of "{key}" is empty')
            values[key] = SecretValue(raw)
        return values
