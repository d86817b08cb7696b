"""A client's JSON schema checked against the JSON Schema meta-schema, so that a 400 says where in the schema the
mistake is (llguidance's own errors name the problem, not its place)."""

from __future__ import annotations

import copy
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


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")


def closed_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of the schema with `additionalProperties: false` on each object schema that lists properties and says
    nothing of others: the model writes the declared keys only (still valid against the schema as sent), instead of
    inventing more until max_tokens. For tool arguments, and for response_format's json_schema with strict: true
    (OpenAI's strict mode writes no undeclared keys)."""
    schema = copy.deepcopy(schema)
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if (isinstance(node.get("properties"), dict) and "additionalProperties" not in node
                and "patternProperties" not in node and "unevaluatedProperties" not in node):
            node["additionalProperties"] = False
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        for key in _SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
        if isinstance(node.get("items"), (dict, list)):
            stack.extend(node["items"] if isinstance(node["items"], list) else [node["items"]])
    return schema
