"""Application builders for Serve config files (KubeRay serveConfigV2, `serve run`):
`gateway.serving.builders:gateway_builder` and `gateway.serving.builders:model_builder` with args
{"spec": "path/to/model.yaml"}. Other args are Settings fields.

model_builder records the spec in the database as `platform deploy` does (its prices, its side of the router): a
model deployed from a serve config is priced and routed like one deployed by the command."""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from billing.db import make_engine
from billing.deployments import record_deployments

from gateway.serving.gateway_app import gateway_application
from gateway.serving.model_app import model_application
from gateway.settings import Settings
from gateway.specs import load_spec, parse_spec


def gateway_builder(args: dict[str, Any]) -> Application:
    return gateway_application(Settings.load(**(args or {})))


def model_builder(args: dict[str, Any]) -> Application:
    args = dict(args or {})
    spec_arg = args.pop("spec")
    spec = parse_spec(spec_arg) if isinstance(spec_arg, dict) else load_spec(spec_arg)
    settings = Settings.load(**args)
    db = make_engine(settings.db_url)
    try:
        record_deployments(db, [spec.model_dump(mode="json")])
    finally:
        db.dispose()
    return model_application(spec, settings)
