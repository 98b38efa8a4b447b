"""``--ds-set KEY=JSON`` for the examples: override one ds_config entry by its dotted path."""

from __future__ import annotations

import json
from typing import Iterable


def apply_ds_set(cfg: dict, items: Iterable[str]) -> dict:
    """Apply ``KEY=VALUE`` overrides to ``cfg`` in place (VALUE parsed as JSON when it can be, else a string)
    and return it; a malformed item or a path through a non-object stops the program naming it."""
    for item in items:
        if "=" not in item:
            raise SystemExit(f"--ds-set expects KEY=VALUE, got {item!r}")
        key, raw = item.split("=", 1)
        key = key.strip()
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw  # a bare string
        parts = key.split(".")
        node = cfg
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise SystemExit(f"--ds-set {key}: {part!r} is not a JSON object in the ds_config")
            node = nxt
        node[parts[-1]] = value
    return cfg
