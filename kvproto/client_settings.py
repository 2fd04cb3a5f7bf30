"""The settings every directory client shares (replica URLs, token, tenant), and reading secret files."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, PrivateAttr, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvproto.addresses import url_list
from kvproto.schemas import TENANT_MAX_LEN, TENANT_PATTERN


def read_secret_file(path: Path | None, what: str) -> SecretStr | None:
    """The stripped content of a secret file (a Docker or Kubernetes secret), or None without a path."""
    if path is None:
        return None
    try:
        value = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the {what} file: {exc}") from exc
    if not value:
        raise ValueError(f"the {what} file {path} is empty")
    return SecretStr(value)


class DirectoryClientSettings(BaseSettings):
    """What every component that talks to the directory needs: where the replicas are, its token and its tenant."""

    model_config = SettingsConfigDict(env_prefix="KVDIR_", extra="forbid")

    directory: str = Field("http://127.0.0.1:8101", description="comma-separated URLs of the directory replicas")
    directory_token_file: Path | None = Field(
        None, description="file holding the bearer token sent to the directory (needed when it has an auth tokens file)"
    )
    tenant: str = Field(
        "",
        max_length=TENANT_MAX_LEN,
        pattern=TENANT_PATTERN,
        description="tenant whose directory entries this reads and writes (default: the token's, else the shared one)",
    )

    _directory_token: SecretStr | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _token_from_file(self) -> DirectoryClientSettings:
        self._directory_token = read_secret_file(self.directory_token_file, "directory token")
        return self

    @property
    def directory_token(self) -> SecretStr | None:
        """The token read from `directory_token_file` when the settings were read."""
        return self._directory_token

    @property
    def directory_urls(self) -> list[str]:
        return url_list(self.directory)
