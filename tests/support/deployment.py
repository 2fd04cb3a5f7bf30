"""The shipped docker-compose.yml as `kvdir check-config --compose` reads it, for the deployment tests of every tier."""

from __future__ import annotations

from pathlib import Path

from kvdir.check_config import STAND_IN_SECRET, compose_services

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
SECRETS = ROOT / "deploy" / "secrets"


def stand_in_services(directory: Path) -> dict[str, tuple[str, list[str], dict[str, str]]]:
    """Each kvdir service of docker-compose.yml as (role, args, env), secrets replaced by a file in `directory`."""
    stand_in = directory / "secret"
    stand_in.write_text(STAND_IN_SECRET)
    return compose_services(COMPOSE, stand_in)
