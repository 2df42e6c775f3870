"""`register_schemas()`: the schemas of `config/schema.py` in Hydra's ConfigStore, and the path resolvers.

Called once by the entry point (`__main__.py`) and by whoever composes a config without it (tests,
benchmarks); idempotent.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from prmppo.config.paths import register_path_resolvers
from prmppo.config.schema import SCHEMAS, RootConfig


def register_schemas() -> None:
    """Register the root schema and every group schema in Hydra's ConfigStore (idempotent)."""
    register_path_resolvers()  # ${prmppo.from_launch_dir:...}, ${prmppo.beside_env:...}: config/paths.py
    store = ConfigStore.instance()
    store.store(name="root_schema", node=RootConfig)
    for group, options in SCHEMAS.items():
        for name, node in options.items():
            store.store(name=f"{group}_{name}_schema", node=node)
