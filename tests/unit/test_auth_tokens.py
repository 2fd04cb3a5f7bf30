"""The tokens file, roles, node patterns and tenants, and the settings that read token and secret files (no sockets)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from adapters.config import EventsSettings
from directory.auth import Principal, bearer_token, load_tokens
from directory.config import DirectorySettings
from directory.tenancy import Tenancy
from gateway.config import GatewaySettings
from kvdir.local_cluster import AuthFiles
from worker_stub.config import WorkerSettings


def _file(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "tokens"
    p.write_text(text)
    return p


def test_tokens_file_format(tmp_path: Path) -> None:
    table = load_tokens(
        _file(
            tmp_path,
            """
# comment
engine:worker-*:s3cr3t
  gateway:*:abc
admin:*:x:y:z
""",
        )
    )
    assert len(table) == 3
    assert table.find(b"s3cr3t") == Principal("engine", "worker-*", 3)
    assert table.find(b"abc").role == "gateway"
    assert table.find(b"x:y:z").role == "admin"  # the token is everything after the second colon
    for unknown in (b"", b"s3cr3", b"s3cr3tt", b"S3CR3T", b"abc "):
        assert table.find(unknown) is None


@pytest.mark.parametrize(
    "text,message",
    [
        ("", "no tokens"),
        ("# only a comment\n", "no tokens"),
        ("engine:worker-1\n", r"ROLE\[@TENANT\]:NODE_PATTERN:TOKEN"),
        ("root:*:abc\n", "unknown role"),
        ("engine::abc\n", "empty node pattern"),
        ("engine:*:\n", "non-empty"),
        ("engine:*:two words\n", "without spaces"),
        ("engine:*:abc\nadmin:*:abc\n", "twice"),
        ("engine@:*:abc\n", "a tenant is"),
        ("gateway@a b:*:abc\n", "a tenant is"),
        ("gateway@a/b:*:abc\n", "a tenant is"),
        (f"gateway@{'t' * 65}:*:abc\n", "a tenant is"),
        ("admin@acme:*:abc\n", "admin tokens cannot be confined"),
        ("root@acme:*:abc\n", "unknown role"),
    ],
)
def test_malformed_tokens_files_are_refused_without_echoing_secrets(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as e:
        load_tokens(_file(tmp_path, text))
    assert "abc" not in str(e.value)


def test_tokens_confined_to_a_tenant(tmp_path: Path) -> None:
    table = load_tokens(
        _file(
            tmp_path,
            """
engine@acme:worker-*:e1
gateway@acme.eu-2_x:*:g1
gateway:*@x:g2
""",
        )
    )
    assert table.confined
    assert table.find(b"e1") == Principal("engine", "worker-*", 2, "acme")
    assert table.find(b"g1").tenant == "acme.eu-2_x"
    # `@` in NODE_PATTERN is part of the pattern (node ids may contain it), not a tenant.
    assert table.find(b"g2") == Principal("gateway", "*@x", 4, None)
    assert str(table.find(b"e1")) == "engine@acme:worker-* (line 2)"
    assert not load_tokens(_file(tmp_path, "engine:*:a\nadmin:*:b\n")).confined


def test_the_tenant_a_request_acts_in() -> None:
    confined = Principal("gateway", "*", 1, "acme")
    assert confined.tenant_for(None) == "acme"  # names none: its own
    assert confined.tenant_for("acme") == "acme"
    assert confined.tenant_for("") is None  # not even the shared tenant
    assert confined.tenant_for("other") is None
    assert confined.tenant_for("Acme") is None
    for free in (Principal("engine", "*", 1), Principal("admin", "*", 1)):
        assert free.tenant_for(None) == "" and free.tenant_for("") == ""
        assert free.tenant_for("acme") == "acme" and free.tenant_for("other") == "other"


def test_roles_may_write() -> None:
    engine = Principal("engine", "worker-*", 1)
    assert engine.may_write("worker-1") and engine.may_write("worker-a.b")
    assert not engine.may_write("other-1") and not engine.may_write("worker") and not engine.may_write("Worker-1")
    assert Principal("engine", "vllm-[ab]?", 1).may_write("vllm-a7")
    assert not Principal("gateway", "*", 1).may_write("worker-1")
    assert Principal("admin", "*", 1).may_write("anything")


def test_bearer_header_parsing() -> None:
    def scope(*headers: tuple[bytes, bytes]) -> dict:
        return {"headers": list(headers)}

    assert bearer_token(scope((b"authorization", b"Bearer abc"))) == b"abc"
    assert bearer_token(scope((b"authorization", b"bearer   abc "))) == b"abc"
    assert bearer_token(scope()) is None
    assert bearer_token(scope((b"authorization", b"Basic abc"))) is None
    assert bearer_token(scope((b"authorization", b"Bearer"))) is None
    assert bearer_token(scope((b"authorization", b"abc"))) is None


def test_confined_tokens_need_a_tenant_secret(tmp_path: Path) -> None:
    tokens = _file(tmp_path, "gateway@acme:*:xyz\n")
    with pytest.raises(ValidationError, match="need a tenant secret") as e:
        DirectorySettings(auth_tokens_file=tokens)
    assert "xyz" not in str(e.value)
    secret = tmp_path / "secret"
    secret.write_text("k3y\n")
    s = DirectorySettings(auth_tokens_file=tokens, tenant_secret_file=secret)
    assert s.auth_tokens.find(b"xyz").tenant == "acme"
    hashes = np.arange(4, dtype=np.uint64)
    assert not np.array_equal(s.tenancy.keys(hashes, "acme"), DirectorySettings().tenancy.keys(hashes, "acme"))
    assert s.tenancy.key("acme") == Tenancy(b"k3y").key("acme")  # stripped, as every secret file
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValidationError, match="empty"):
        DirectorySettings(tenant_secret_file=tmp_path / "empty")


def test_clients_take_a_tenant(monkeypatch) -> None:
    for cls in (WorkerSettings, GatewaySettings, EventsSettings):
        assert cls().tenant == ""
        assert cls(tenant="acme-1").tenant == "acme-1"
        monkeypatch.setenv("KVDIR_TENANT", "acme.2")
        assert cls().tenant == "acme.2"
        monkeypatch.delenv("KVDIR_TENANT")
        for bad in ("a b", "a:b", "a@b", "t" * 65):
            with pytest.raises(ValidationError, match="tenant"):
                cls(tenant=bad)


def test_settings_read_token_files(tmp_path: Path, monkeypatch) -> None:
    assert DirectorySettings().auth_tokens is None  # auth off by default
    tokens = _file(tmp_path, "admin:*:xyz\n")
    monkeypatch.setenv("KVDIR_AUTH_TOKENS_FILE", str(tokens))
    assert DirectorySettings().auth_tokens.find(b"xyz").role == "admin"
    monkeypatch.delenv("KVDIR_AUTH_TOKENS_FILE")
    with pytest.raises(ValidationError, match="unknown role"):
        DirectorySettings(auth_tokens_file=_file(tmp_path, "root:*:xyz\n"))
    with pytest.raises(ValidationError, match="cannot read"):
        DirectorySettings(auth_tokens_file=tmp_path / "missing")
    token = tmp_path / "token"
    token.write_text("  s3cr3t\n")
    for cls in (WorkerSettings, GatewaySettings):
        assert cls().directory_token is None
        assert cls(directory_token_file=token).directory_token.get_secret_value() == "s3cr3t"
        assert "s3cr3t" not in repr(cls(directory_token_file=token))
        empty = tmp_path / "empty"
        empty.write_text("\n")
        with pytest.raises(ValidationError, match="empty"):
            cls(directory_token_file=empty)


def test_kvdir_up_auth_files(tmp_path: Path) -> None:
    first = AuthFiles.generate(tmp_path / "secrets", ["worker-1", "worker-2"])
    old_admin = first.admin_token()
    files = AuthFiles.generate(tmp_path / "secrets", ["worker-1", "worker-2"])  # a restart: fresh secrets, same paths
    assert files == first and files.admin_token() != old_admin
    table = load_tokens(files.tokens)
    assert len(table) == 4
    token = {
        name: path.read_text().strip()
        for name, path in [("admin", files.admin), ("gateway", files.gateway), *files.engines.items()]
    }
    assert table.find(token["admin"].encode()).role == "admin"
    assert table.find(token["gateway"].encode()).role == "gateway"
    engine = table.find(token["worker-1"].encode())
    assert engine.may_write("worker-1") and not engine.may_write("worker-2") and not engine.may_write("worker-10")
    settings = DirectorySettings(auth_tokens_file=files.tokens, raft_password_file=files.raft_password)
    assert settings.raft_password is not None and len(settings.raft_password.get_secret_value()) >= 40
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in files.dir.iterdir())
    assert files.dir.stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("tokens_file", [True, False])
def test_auth_off_warning_only_when_auth_is_off(tmp_path: Path, caplog: pytest.LogCaptureFixture, tokens_file: bool) -> None:
    # A replica with a tokens file once also warned "auth is off" (docker-compose's replicas did, with auth on).
    from directory.api import create_app

    tokens = _file(tmp_path, "admin:*:s3cr3t\n") if tokens_file else None
    with caplog.at_level("INFO", logger="kvdir.directory"):
        create_app(DirectorySettings(http="0.0.0.0:8101", auth_tokens_file=tokens))
    warned = any("auth is off" in r.getMessage() for r in caplog.records)
    assert warned is not tokens_file
    assert any("bearer-token auth on" in r.getMessage() for r in caplog.records) is tokens_file
