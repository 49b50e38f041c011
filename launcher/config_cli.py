"""``asyncrl config show [FILE] [section.key=value ...] [--json]``: the resolved run config.

Prints every section with defaults, file values, ``ASYNCRL_…`` variables and arguments
applied (secrets masked), then verl's derived numbers computed by
:class:`asyncrl.config.DerivedNumbers`. An invalid value exits with status 2 and a message
naming the field, its source and the allowed range.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import yaml

from asyncrl.cli_args import resolve_config
from asyncrl.config import RunConfig

SECRET_MASK = "**********"


def resolved_document(cfg: RunConfig) -> dict:
    """The config as plain data with secrets masked, plus a ``derived`` section."""
    data = cfg.model_dump(mode="json")
    for key, value in cfg.security.model_dump().items():
        if value is not None and key.endswith(("token", "password")):
            data["security"][key] = SECRET_MASK
    if cfg.engines.api_key is not None:
        data["engines"]["api_key"] = SECRET_MASK
    data["derived"] = cfg.derived.model_dump()
    return data


def port_notes(cfg: RunConfig) -> list[str]:
    """Comment lines for the service ports the config leaves unset (docs/config.md, "Ports")."""
    unset = [(key, alone) for key, value, alone in (
        ("rollout.port", cfg.rollout.port, cfg.rollout.listen_port), ("sync.port", cfg.sync.port, cfg.sync.listen_port),
        ("trainer.metrics_port", cfg.trainer.metrics_port, cfg.trainer.metrics_listen_port)) if value is None]
    if not unset:
        return []
    return [f"# unset ports: {', '.join(k for k, _ in unset)}: asyncrl up and asyncrl slurm draw free ones",
            f"#   (two runs on one machine never meet); a service started alone binds {', '.join(f'{k}={p}' for k, p in unset)}"]


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="asyncrl config", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["show"], help="show: print the resolved config")
    parser.add_argument("args", nargs="*", help="[CONFIG_FILE] [section.key=value ...]")
    parser.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    ns = parser.parse_args(argv)
    cfg = resolve_config(ns.args)
    if cfg is None:
        return 2
    doc = resolved_document(cfg)
    if ns.json:
        print(json.dumps(doc, indent=2))
    else:
        derived = doc.pop("derived")
        print(yaml.safe_dump(doc, sort_keys=False).rstrip())
        for line in port_notes(cfg):
            print(line)
        print("\n# derived (verl's fully_async_policy formulas, see docs/config.md)")
        print(yaml.safe_dump({"derived": derived}, sort_keys=False).rstrip())
    return 0
