"""JSON-schema keywords xgrammar accepts but does not enforce: refused by name, before compiling.

xgrammar 0.2.8 compiles these and then lets through output that breaks them (each was checked by
compiling a schema with it and feeding the grammar an instance `jsonschema` rejects):
`not`, `allOf` of more than one schema (it keeps one), `if`/`then`/`else`, `uniqueItems`,
`contains`/`minContains`/`maxContains`, `dependentRequired`/`dependentSchemas`/`dependencies`,
`$dynamicRef`/`$recursiveRef`, a `$ref` that is not a local JSON pointer ("#" or "#/...": a URL or
an anchor is read as "any value"), and `oneOf` whose branches may overlap (enforced as `anyOf`,
so an output may match two). A caller asking for these gets INVALID_ARGUMENT naming the keyword
and where it is, rather than output that does not match its schema.
"""

from __future__ import annotations

from loraplex.services.inference.errors import InvalidRequest

UNENFORCED = (
    "not",
    "if",
    "then",
    "else",
    "contains",
    "minContains",
    "maxContains",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "$dynamicRef",
    "$recursiveRef",
)
# Where a schema holds other schemas (their contents are checked too; `const`, `enum`, `default`
# and `examples` hold data, which may use these words freely).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = (
    "additionalProperties",
    "additionalItems",
    "items",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "not",
    "if",
    "then",
    "else",
)
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


def check_schema_keywords(schema, field: str) -> None:
    """Raise InvalidRequest naming the first keyword of `schema` this server cannot enforce."""
    _check(schema, "#", schema, field)


def _refuse(field: str, where: str, keyword: str, why: str = "") -> InvalidRequest:
    return InvalidRequest(
        f"{field} uses {keyword!r} at {where}, which this server cannot enforce"
        f"{': ' + why if why else ''}; remove it or express it another way",
        field=field,
    )


def _check(node, where: str, root, field: str) -> None:
    if not isinstance(node, dict):
        return
    for keyword in UNENFORCED:
        if keyword in node:
            raise _refuse(field, where, keyword)
    if node.get("uniqueItems") is True:
        raise _refuse(field, where, "uniqueItems")
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        raise _refuse(field, where, "allOf", "only one of its schemas would be kept; merge them")
    ref = node.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        raise _refuse(field, where, "$ref", f"{ref!r} is not a local reference ('#/...')")
    one_of = node.get("oneOf")
    if isinstance(one_of, list) and not _pairwise_disjoint(one_of, root):
        raise _refuse(
            field,
            where,
            "oneOf",
            "its branches may overlap and would be enforced as anyOf; use anyOf, or give the "
            "branches different types or a required property with different const values",
        )
    for key in _SCHEMA_MAPS:
        sub = node.get(key)
        if isinstance(sub, dict):
            for name, child in sub.items():
                _check(child, f"{where}/{key}/{_escape(name)}", root, field)
    for key in _SCHEMA_ONE:
        if isinstance(node.get(key), dict):
            _check(node[key], f"{where}/{key}", root, field)
    for key in _SCHEMA_LISTS:
        sub = node.get(key)
        if isinstance(sub, list):
            for i, child in enumerate(sub):
                _check(child, f"{where}/{key}/{i}", root, field)


def _escape(name: str) -> str:
    """A JSON-pointer token (RFC 6901)."""
    return str(name).replace("~", "~0").replace("/", "~1")


def _resolve(node, root, depth: int = 0):
    """`node` with a local `$ref` followed (a few hops at most); None where it cannot be followed."""
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and depth < 8:
        ref = node["$ref"]
        target = root
        if ref != "#":
            if not ref.startswith("#/"):
                return None
            for token in ref[2:].split("/"):
                token = token.replace("~1", "/").replace("~0", "~")
                if isinstance(target, dict) and token in target:
                    target = target[token]
                elif isinstance(target, list) and token.isdigit() and int(token) < len(target):
                    target = target[int(token)]
                else:
                    return None
        node, depth = target, depth + 1
    return node if isinstance(node, dict) else None


def _types(node: dict) -> set[str] | None:
    t = node.get("type")
    if isinstance(t, str):
        types = {t}
    elif isinstance(t, list) and all(isinstance(x, str) for x in t):
        types = set(t)
    else:
        return None
    if "integer" in types:
        types.add("number")  # an integer is a number
    return types


def _values(node) -> list | None:
    """The values `node` allows, when it lists them (const / enum)."""
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return [node["const"]]
    enum = node.get("enum")
    return list(enum) if isinstance(enum, list) else None


def _tag_values(node: dict, name: str) -> list | None:
    """The values a required property `name` of `node` may take, when it says (const / enum)."""
    if name not in (node.get("required") or ()):
        return None
    return _values((node.get("properties") or {}).get(name))


def _disjoint(a: dict, b: dict) -> bool:
    ta, tb = _types(a), _types(b)
    if ta is not None and tb is not None and not ta & tb:
        return True
    va, vb = _values(a), _values(b)
    if va is not None and vb is not None and not any(x == y for x in va for y in vb):
        return True
    for name in set(a.get("required") or ()) & set(b.get("required") or ()):
        va, vb = _tag_values(a, name), _tag_values(b, name)
        if va is not None and vb is not None and not any(x == y for x in va for y in vb):
            return True
    return False


def _pairwise_disjoint(branches: list, root) -> bool:
    resolved = [_resolve(b, root) for b in branches]
    if any(r is None for r in resolved):
        return len(branches) <= 1
    return all(_disjoint(resolved[i], resolved[j]) for i in range(len(resolved)) for j in range(i))
