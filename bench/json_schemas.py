"""JSON schemas of varied shape, each with a prompt that asks for it and one valid instance: the corpus the
structured-output tests run on SmolLM2 and the benchmarks compile and walk (bench/grammar_libraries.py,
bench/structured.py). Shapes: flat and nested objects, arrays (bounded, of objects, of enums), enums and consts,
integers and numbers with bounds, optional and nullable fields, anyOf, $defs with $ref, string lengths and patterns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SchemaCase:
    name: str
    schema: dict[str, Any]
    prompt: str
    example: Any  # one instance that validates


def _obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False, **extra}


_STR = {"type": "string", "maxLength": 40}
_NAME = {"type": "string", "minLength": 1, "maxLength": 30}

CASES: list[SchemaCase] = [
    SchemaCase("person", _obj({"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
               "Describe a person called Ana who is 31.", {"name": "Ana", "age": 31}),
    SchemaCase("city", _obj({"city": _NAME, "country": _NAME, "population": {"type": "integer", "minimum": 0}}),
               "Give the capital of France and its population.",
               {"city": "Paris", "country": "France", "population": 2100000}),
    SchemaCase("flag", _obj({"answer": {"type": "boolean"}}), "Is water wet? Answer as JSON.", {"answer": True}),
    SchemaCase("sentiment", _obj({"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                  "confidence": {"type": "number", "minimum": 0, "maximum": 1}}),
               "Classify the sentiment of: 'I love this phone'.", {"sentiment": "positive", "confidence": 0.9}),
    SchemaCase("temperature", _obj({"celsius": {"type": "number", "minimum": -90, "maximum": 60},
                                    "unit": {"const": "C"}}),
               "What is a typical summer temperature in Madrid?", {"celsius": 31.5, "unit": "C"}),
    SchemaCase("tags", _obj({"tags": {"type": "array", "items": {"type": "string", "maxLength": 15},
                                      "minItems": 1, "maxItems": 4}}),
               "List some tags for a blog post about Python.", {"tags": ["python", "code"]}),
    SchemaCase("scores", _obj({"scores": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 10},
                                          "minItems": 3, "maxItems": 3}}),
               "Rate three movies from 1 to 10.", {"scores": [7, 9, 4]}),
    SchemaCase("address", _obj({"name": _NAME, "address": _obj({"street": _STR, "city": _NAME,
                                                                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}),
               "Write a US mailing address for John.",
               {"name": "John", "address": {"street": "1 Main St", "city": "Springfield", "zip": "12345"}}),
    SchemaCase("order", _obj({"order_id": {"type": "integer", "minimum": 1},
                              "items": {"type": "array", "maxItems": 3, "items": _obj({
                                  "sku": {"type": "string", "maxLength": 12},
                                  "quantity": {"type": "integer", "minimum": 1, "maximum": 99}})},
                              "paid": {"type": "boolean"}}),
               "Make an order of two books.",
               {"order_id": 7, "items": [{"sku": "BOOK1", "quantity": 2}], "paid": False}),
    SchemaCase("optional_fields", _obj({"title": _NAME, "subtitle": _STR, "year": {"type": "integer",
                                                                                   "minimum": 1900, "maximum": 2100}},
                                       required=["title"]),
               "Describe a book you like.", {"title": "Dune", "year": 1965}),
    SchemaCase("nullable", _obj({"nickname": {"type": ["string", "null"], "maxLength": 20},
                                 "email": {"anyOf": [{"type": "string", "maxLength": 40}, {"type": "null"}]}}),
               "Give a user profile; unknown fields are null.", {"nickname": None, "email": "a@b.c"}),
    SchemaCase("color", _obj({"color": {"enum": ["red", "green", "blue", "yellow"]},
                              "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
               "Pick a colour and give its hex code.", {"color": "red", "hex": "#ff0000"}),
    SchemaCase("point", _obj({"x": {"type": "number", "minimum": -10, "maximum": 10},
                              "y": {"type": "number", "minimum": -10, "maximum": 10}}),
               "Give a point in the plane near the origin.", {"x": 1.5, "y": -2}),
    SchemaCase("matrix", _obj({"rows": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": -9, "maximum": 9}}}}),
               "Write a 2x2 identity matrix.", {"rows": [[1, 0], [0, 1]]}),
    SchemaCase("event", _obj({"name": _NAME, "day": {"type": "integer", "minimum": 1, "maximum": 31},
                              "month": {"enum": ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep",
                                                 "Oct", "Nov", "Dec"]},
                              "attendees": {"type": "integer", "minimum": 0, "maximum": 1000}}),
               "Plan a birthday party.", {"name": "Party", "day": 12, "month": "May", "attendees": 20}),
    SchemaCase("recipe", _obj({"dish": _NAME, "ingredients": {"type": "array", "minItems": 1, "maxItems": 5,
                                                              "items": _obj({"name": _NAME,
                                                                             "grams": {"type": "integer",
                                                                                       "minimum": 1,
                                                                                       "maximum": 2000}})},
                               "vegetarian": {"type": "boolean"}}),
               "Give a simple pancake recipe.",
               {"dish": "Pancakes", "ingredients": [{"name": "flour", "grams": 200}], "vegetarian": True}),
    SchemaCase("status", {"enum": ["ok", "warning", "error"]}, "Report the status of a healthy server.", "ok"),
    SchemaCase("count", {"type": "integer", "minimum": 0, "maximum": 100}, "How many legs does a spider have?", 8),
    SchemaCase("list_of_numbers", {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1000},
                                   "minItems": 1, "maxItems": 5},
               "List the first few prime numbers.", [2, 3, 5]),
    SchemaCase("defs_ref", {"$defs": {"pet": _obj({"kind": {"enum": ["cat", "dog", "fish"]}, "name": _NAME})},
                            **_obj({"owner": _NAME, "pets": {"type": "array", "maxItems": 3,
                                                             "items": {"$ref": "#/$defs/pet"}}})},
               "Describe Maria and her pets.", {"owner": "Maria", "pets": [{"kind": "cat", "name": "Tom"}]}),
    SchemaCase("anyof_shape", _obj({"shape": {"anyOf": [
        _obj({"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0, "maximum": 100}}),
        _obj({"kind": {"const": "square"}, "side": {"type": "number", "minimum": 0, "maximum": 100}})]}}),
               "Describe a circle of radius 2.", {"shape": {"kind": "circle", "radius": 2}}),
    SchemaCase("deep_nesting", _obj({"a": _obj({"b": _obj({"c": _obj({"d": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9}})})})}),
               "Fill in a nested object.", {"a": {"b": {"c": {"d": 4}}}}),
    SchemaCase("exclusive_bounds", _obj({"probability": {"type": "number", "exclusiveMinimum": 0,
                                                         "exclusiveMaximum": 1},
                                         "rank": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5}}),
               "Estimate the chance of rain tomorrow and rank it.", {"probability": 0.3, "rank": 2}),
    SchemaCase("product", _obj({"name": _NAME, "price": {"type": "number", "minimum": 0, "maximum": 10000},
                                "currency": {"enum": ["USD", "EUR", "GBP"]},
                                "in_stock": {"type": "boolean"},
                                "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                         "maxItems": 3}},
                               required=["name", "price", "currency"]),
               "Describe a laptop for sale.", {"name": "Laptop", "price": 999.99, "currency": "USD"}),
    SchemaCase("weekdays", _obj({"days": {"type": "array", "minItems": 1, "maxItems": 7,
                                          "items": {"enum": ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]}}}),
               "Which days are weekend days?", {"days": ["Sat", "Sun"]}),
    SchemaCase("short_answer", _obj({"answer": {"type": "string", "minLength": 1, "maxLength": 10}}),
               "What is the capital of Italy? Answer in one word.", {"answer": "Rome"}),
    SchemaCase("pair", {"type": "array", "prefixItems": [{"type": "string", "maxLength": 10},
                                                         {"type": "integer", "minimum": 0, "maximum": 99}],
                        "items": False, "minItems": 2},
               "Give a name and an age as a pair.", ["Bob", 42]),
    SchemaCase("review", _obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                               "pros": {"type": "array", "items": _STR, "maxItems": 2},
                               "cons": {"type": "array", "items": _STR, "maxItems": 2},
                               "summary": {"type": "string", "maxLength": 60}}),
               "Review a coffee shop.", {"stars": 4, "pros": ["good coffee"], "cons": [], "summary": "Nice."}),
    SchemaCase("coordinates", _obj({"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                    "lon": {"type": "number", "minimum": -180, "maximum": 180},
                                    "label": _STR}, required=["lat", "lon"]),
               "Give the coordinates of Paris.", {"lat": 48.85, "lon": 2.35}),
    SchemaCase("task_list", _obj({"tasks": {"type": "array", "minItems": 1, "maxItems": 3, "items": _obj({
        "title": _NAME, "done": {"type": "boolean"}, "priority": {"enum": ["low", "medium", "high"]}})}}),
               "Make a to-do list for a Saturday.",
               {"tasks": [{"title": "Shop", "done": False, "priority": "high"}]}),
    SchemaCase("multiple_of", _obj({"minutes": {"type": "integer", "minimum": 0, "maximum": 60, "multipleOf": 15}}),
               "How long is a short meeting, in minutes (a multiple of 15)?", {"minutes": 30}),
    SchemaCase("employee", _obj({"id": {"type": "integer", "minimum": 1000, "maximum": 9999},
                                 "name": _obj({"first": _NAME, "last": _NAME}),
                                 "department": {"enum": ["sales", "engineering", "hr"]},
                                 "manager_id": {"type": ["integer", "null"], "minimum": 1000, "maximum": 9999},
                                 "skills": {"type": "array", "items": {"type": "string", "maxLength": 15},
                                            "maxItems": 3}},
                                required=["id", "name", "department"]),
               "Describe an engineer at a company.",
               {"id": 1234, "name": {"first": "Li", "last": "Wei"}, "department": "engineering"}),
    SchemaCase("uuid_like", _obj({"id": {"type": "string", "pattern": "^[0-9a-f]{8}-[0-9a-f]{4}$"}}),
               "Make up a short identifier.", {"id": "deadbeef-0a1b"}),
    SchemaCase("min_properties_free", {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 100},
                                       "maxProperties": 3},
               "Give the ages of up to three people as a JSON object of name to age.", {"Ana": 31}),
]
