"""What the tests' fork server (tests/support/forked.py) loads once for every service it forks: each role's settings
and entry modules, and the index's compiled kernels (each service process would otherwise load them from numba's cache
itself)."""

from __future__ import annotations

import importlib

from kvdir.roles import ROLES
from kvproto.index import warm_up

for role in ROLES.values():
    for name in (role.settings_class, role.entry):
        importlib.import_module(name.split(":")[0])
warm_up()
