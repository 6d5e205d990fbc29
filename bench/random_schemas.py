"""Random JSON schemas for constrained-decoding tests: nested objects, arrays, enums, bounded
numbers and strings with patterns. Every schema is finite enough that a small model can finish
it in a few hundred tokens (strings and arrays bounded), as ordinary extraction schemas are."""

from __future__ import annotations

import random

PATTERNS = ["^[a-z]{1,8}$", "^[A-Z][a-z]{0,6}$", "^[0-9]{3}-[0-9]{2}$", "^(yes|no|maybe)$"]
WORDS = ["red", "green", "blue", "cat", "dog", "paris", "tokyo", "alpha", "beta", "x"]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema with 1-4 properties, some required, nested up to two levels."""
    props = {}
    for i in range(rng.randint(1, 4)):
        props[f"{rng.choice(WORDS)}_{i}"] = _value(rng, depth + 1)
    required = [k for k in props if rng.random() < 0.7]
    schema = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    return schema


def _value(rng: random.Random, depth: int) -> dict:
    kinds = ["string", "pattern", "enum", "integer", "number", "boolean", "array"]
    if depth < 3:
        kinds.append("object")
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "number":
        # Unbounded precision: a number is a sequence of digits the model ends when it likes; the
        # bound keeps its value in range.
        return {"type": "number", "minimum": -10, "maximum": 1000}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": _value(rng, depth + 1), "maxItems": rng.randint(1, 3)}
    return random_schema(rng, depth)
