"""FileStore (permissions, reload), EnvStore, and the config factory."""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import Any

import pytest
from helpers.clock import run

from gateway.services.secrets import (
    AzureKeyVaultStore,
    EnvStore,
    FileStore,
    SecretCache,
    SecretNotFound,
    SecretStore,
    SecretStoreConfigError,
    SecretStoreError,
    build_cache,
    build_store,
    env_var_name,
    parse_duration,
)

VALUE = "sk-file-secret-7f3a9c"



def write(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    os.chmod(path, mode)
    return path


# ------------------------------------------------------------------ FileStore
def test_file_store_reads_values(tmp_path: Path) -> None:
    p = write(tmp_path / "s.yaml", f'openai-api-key: "{VALUE}"\nother: plain-text\n')
    store = FileStore(p)
    assert isinstance(store, SecretStore)
    assert store.name == "file"
    assert run(store.fetch("openai-api-key")).reveal() == VALUE
    assert run(store.fetch("other")).reveal() == "plain-text"


def test_file_store_not_found_says_what_to_do(tmp_path: Path) -> None:
    p = write(tmp_path / "s.yaml", "a: b\n")
    with pytest.raises(SecretNotFound) as info:
        run(FileStore(p).fetch("openai-api-key"))
    msg = str(info.value)
    assert msg.startswith(f'secret "openai-api-key" is not in the file store {p}; add it')
    assert info.value.secret_name == "openai-api-key"


@pytest.mark.parametrize("mode", [0o604, 0o606, 0o644, 0o666, 0o601, 0o602])
def test_file_store_refuses_files_open_to_others(tmp_path: Path, mode: int) -> None:
    p = write(tmp_path / "s.yaml", f"k: {VALUE}\n", mode)
    with pytest.raises(SecretStoreConfigError) as info:
        FileStore(p)
    msg = str(info.value)
    assert str(p) in msg and f"chmod 600 {p}" in msg and "other users" in msg
    assert VALUE not in msg
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o640, 0o660, 0o440])
def test_file_store_allows_owner_and_group(tmp_path: Path, mode: int) -> None:
    p = write(tmp_path / "s.yaml", f"k: {VALUE}\n", mode)
    assert run(FileStore(p).fetch("k")).reveal() == VALUE


def test_file_store_refuses_after_chmod_to_world_readable(tmp_path: Path) -> None:
    p = write(tmp_path / "s.yaml", f"k: {VALUE}\n")
    store = FileStore(p)
    run(store.fetch("k"))
    os.chmod(p, 0o644)
    with pytest.raises(SecretStoreError, match="chmod 600"):
        run(store.fetch("k"))


def test_file_store_missing_file(tmp_path: Path) -> None:
    p = tmp_path / "nope.yaml"
    with pytest.raises(SecretStoreConfigError) as info:
        FileStore(p)
    assert f"secret file {p} does not exist" in str(info.value)
    assert not p.exists()


def test_file_store_create_if_missing(tmp_path: Path) -> None:
    p = tmp_path / "sub" / "secrets.local.yaml"
    store = FileStore(p, create_if_missing=True)
    assert p.stat().st_mode & 0o777 == 0o600
    assert p.read_text().startswith("#")
    with pytest.raises(SecretNotFound, match="add it"):
        run(store.fetch("openai-api-key"))
    # The template stays valid YAML once a secret is appended.
    with open(p, "a") as f:
        f.write(f"openai-api-key: {VALUE}\n")
    assert run(store.fetch("openai-api-key")).reveal() == VALUE


def test_file_store_reloads_on_edit(tmp_path: Path) -> None:
    p = write(tmp_path / "s.yaml", "k: old-value-1\n")
    store = FileStore(p)
    assert run(store.fetch("k")).reveal() == "old-value-1"
    p.write_text("k: new-value-2\n")  # same size: mtime/inode decide
    st = p.stat()
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert run(store.fetch("k")).reveal() == "new-value-2"


def test_file_store_reloads_on_atomic_replace_same_size_and_mtime(tmp_path: Path) -> None:
    p = write(tmp_path / "s.yaml", "k: value-aaaa\n")
    store = FileStore(p)
    assert run(store.fetch("k")).reveal() == "value-aaaa"
    st = p.stat()
    tmp = write(tmp_path / "s.yaml.tmp", "k: value-bbbb\n")
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp, p)  # new inode, identical size and mtime
    assert run(store.fetch("k")).reveal() == "value-bbbb"


def test_file_store_follows_kubernetes_symlink_swap(tmp_path: Path) -> None:
    """A mounted Secret is ``file -> ..data/file``; updates swap the ``..data`` link."""
    v1, v2 = tmp_path / "..2024_v1", tmp_path / "..2024_v2"
    v1.mkdir()
    v2.mkdir()
    write(v1 / "secrets.yaml", "k: first-value\n", 0o440)
    write(v2 / "secrets.yaml", "k: second-value\n", 0o440)
    os.symlink(v1.name, tmp_path / "..data")
    os.symlink("..data/secrets.yaml", tmp_path / "secrets.yaml")
    store = FileStore(tmp_path / "secrets.yaml")
    assert run(store.fetch("k")).reveal() == "first-value"
    os.symlink(v2.name, tmp_path / "..data_tmp")
    os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
    assert run(store.fetch("k")).reveal() == "second-value"


def test_file_store_yaml_errors_never_quote_the_file(tmp_path: Path) -> None:
    p = write(tmp_path / "s.yaml", f'a: "{VALUE}\nb: [unclosed {VALUE}\n')
    with pytest.raises(SecretStoreConfigError) as info:
        FileStore(p)
    msg = str(info.value)
    assert "not valid YAML" in msg and "line" in msg and str(p) in msg
    chain: list[BaseException] = []
    exc: BaseException | None = info.value
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    for e in chain:
        assert VALUE not in str(e) and VALUE not in repr(e)
    assert VALUE not in "".join(traceback.format_exception(info.value))


def test_file_store_bad_reload_is_a_store_error_then_recovers(tmp_path: Path) -> None:
    p = write(tmp_path / "s.yaml", f"k: {VALUE}\n")
    store = FileStore(p)
    p.write_text(f"k: [{VALUE}\n")
    with pytest.raises(SecretStoreError) as info:
        run(store.fetch("k"))
    assert VALUE not in str(info.value)
    p.write_text(f"k: {VALUE}-2\n")
    assert run(store.fetch("k")).reveal() == f"{VALUE}-2"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("k: 0123\n", 'value of "k" is a int'),
        ("k:\n", 'value of "k" is empty'),
        ('k: ""\n', 'value of "k" is empty'),
        ("k: [a, b]\n", 'value of "k" is a list'),
        ("- a\n- b\n", "must be a map"),
        ("1: x\n", "non-empty string"),
    ],
)
def test_file_store_rejects_non_string_values(tmp_path: Path, text: str, needle: str) -> None:
    p = write(tmp_path / "s.yaml", text)
    with pytest.raises(SecretStoreConfigError, match=needle):
        FileStore(p)


def test_file_store_empty_file_is_fine(tmp_path: Path) -> None:
    p = write(tmp_path / "s.yaml", "# nothing yet\n")
    with pytest.raises(SecretNotFound):
        run(FileStore(p).fetch("x"))


def test_file_store_refuses_a_directory(tmp_path: Path) -> None:
    d = tmp_path / "dir"
    d.mkdir(mode=0o700)
    with pytest.raises(SecretStoreConfigError):
        FileStore(d)


# ------------------------------------------------------------------ EnvStore
def test_env_var_name() -> None:
    assert env_var_name("openai-api-key") == "SANDBOX_GATEWAY_SECRET_OPENAI_API_KEY"
    assert env_var_name("int.key-2") == "SANDBOX_GATEWAY_SECRET_INT_KEY_2"


def test_env_store_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDBOX_GATEWAY_SECRET_OPENAI_API_KEY", VALUE)
    store = EnvStore()
    assert store.name == "env"
    assert isinstance(store, SecretStore)
    assert run(store.fetch("openai-api-key")).reveal() == VALUE
    monkeypatch.setenv("SANDBOX_GATEWAY_SECRET_OPENAI_API_KEY", VALUE + "-rotated")
    assert run(store.fetch("openai-api-key")).reveal() == VALUE + "-rotated"


def test_env_store_not_found_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SANDBOX_GATEWAY_SECRET_MY_KEY", raising=False)
    with pytest.raises(SecretNotFound) as info:
        run(EnvStore().fetch("my.key"))
    assert "SANDBOX_GATEWAY_SECRET_MY_KEY" in str(info.value)


def test_env_store_injected_environ_empty_and_invalid() -> None:
    store = EnvStore({"SANDBOX_GATEWAY_SECRET_A": "", "SANDBOX_GATEWAY_SECRET_B": "v"})
    with pytest.raises(SecretStoreError, match="set but empty"):
        run(store.fetch("a"))
    assert run(store.fetch("b")).reveal() == "v"
    with pytest.raises(SecretStoreError, match="cannot be mapped"):
        run(store.fetch("bad name!"))


# ------------------------------------------------------------------ factory
def test_build_store_default_creates_the_local_file(tmp_path: Path) -> None:
    store = build_store(None, base_dir=tmp_path)
    assert isinstance(store, FileStore)
    assert store.path == tmp_path / "secrets.local.yaml"
    assert (tmp_path / "secrets.local.yaml").stat().st_mode & 0o777 == 0o600


def test_build_store_explicit_path_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        build_store({"store": "file", "path": "missing.yaml"}, base_dir=tmp_path)
    store = build_store(
        {"store": "file", "path": "made.yaml", "create_if_missing": True}, base_dir=tmp_path
    )
    assert isinstance(store, FileStore) and store.path == tmp_path / "made.yaml"


def test_build_store_env_and_azure() -> None:
    assert isinstance(build_store({"store": "env"}), EnvStore)

    async def azure() -> None:
        store = build_store(
            {
                "store": "azure-keyvault",
                "vault_url": "https://myvault.vault.azure.net/",
                "credential": "managed",
                "client_id": "00000000-0000-0000-0000-000000000001",
                "verify_challenge_resource": True,
            }
        )
        assert isinstance(store, AzureKeyVaultStore)
        assert store.vault_url == "https://myvault.vault.azure.net"
        await store.close()

    run(azure())


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"store": "vault"}, "secrets.store: 'vault' is not one of"),
        ({"store": "azure-keyvault"}, "secrets.vault_url: required for store azure-keyvault"),
        ({"store": "env", "path": "x"}, "secrets.path: unknown key for store env"),
        ({"store": "file", "vault_url": "x"}, "secrets.vault_url: unknown key for store file"),
        ({"store": "file", "path": 3}, "secrets.path: expected a non-empty string"),
        ({"store": "file", "create_if_missing": "yes"}, "secrets.create_if_missing: expected"),
        (
            {
                "store": "azure-keyvault",
                "vault_url": "https://x.vault.azure.net",
                "credential": "cli",
            },
            "secrets.credential: 'cli' is not one of",
        ),
        (
            {"store": "azure-keyvault", "vault_url": "http://x.vault.azure.net"},
            "secrets.vault_url: 'http://x.vault.azure.net' must be an https URL",
        ),
        (
            {"store": "azure-keyvault", "vault_url": "https://x.vault.azure.net/secrets/a"},
            "secrets.vault_url: .* base URL only",
        ),
        (
            {
                "store": "azure-keyvault",
                "vault_url": "https://x.vault.azure.net",
                "verify_challenge_resource": "no",
            },
            "secrets.verify_challenge_resource: expected true or false",
        ),
        ({"store": "env", "cache": {"ttl": "soon"}}, "secrets.cache.ttl: 'soon' is not a duration"),
        ({"store": "env", "cache": {"tll": 3}}, "secrets.cache.tll: unknown key"),
    ],
)
def test_build_store_errors_name_the_key(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_store(config)


def test_workload_credential_without_webhook_env_explains(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("AZURE_TENANT_ID", "AZURE_CLIENT_ID", "AZURE_FEDERATED_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(
        SecretStoreConfigError, match=r"secrets\.credential: workload.*AZURE_TENANT_ID"
    ):
        AzureKeyVaultStore("https://x.vault.azure.net", credential="workload")


def test_parse_duration_and_build_cache() -> None:
    assert parse_duration("5m", "k") == 300.0
    assert parse_duration("1h", "k") == 3600.0
    assert parse_duration("250ms", "k") == 0.25
    assert parse_duration(30, "k") == 30.0
    assert parse_duration("45", "k") == 45.0
    with pytest.raises(ValueError, match="k:"):
        parse_duration(True, "k")
    with pytest.raises(ValueError, match="negative"):
        parse_duration(-1, "k")
    cache = build_cache(
        EnvStore(), {"cache": {"ttl": "10m", "refresh_ahead": "1m", "stale_for": "2h"}}
    )
    assert isinstance(cache, SecretCache)
    assert (cache.ttl, cache.refresh_ahead, cache.stale_for) == (600.0, 60.0, 7200.0)
    with pytest.raises(ValueError, match=r"secrets\.cache: refresh_ahead must be"):
        build_cache(EnvStore(), {"cache": {"ttl": 10, "refresh_ahead": 20}})
