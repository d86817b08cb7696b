"""A client's JSON schema checked against the JSON Schema meta-schema, so that a 400 says where in the schema the
mistake is (llguidance's own errors name the problem, not its place)."""

from __future__ import annotations

from typing import Any

import jsonschema
from jsonschema.exceptions import SchemaError

from gateway.errors import APIError, invalid_request


def check_json_schema(schema: dict[str, Any], field: str) -> None:
    """Raises a 400 naming `field` (and the path inside the schema) when `schema` breaks the meta-schema of its
    draft ($schema, else the newest)."""
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except SchemaError as e:
        raise not_a_schema(e, field) from None


def not_a_schema(e: SchemaError, field: str) -> APIError:
    where = "/".join(str(p) for p in e.path)
    return invalid_request(f"{field}: not a valid JSON schema: {e.message}" + (f" (at {where})" if where else ""),
                           field)
