"""Whether a JSON schema has a valid document of finite length: one whose `$ref`s loop with no way out
(`{"$ref": "#"}`, two definitions that refer to each other, a required property of the schema's own
kind) has none, and llguidance then lets a reply end at once with nothing, or never close. Such a
schema is refused before a reply is made under it.

A schema is productive when some finite document is valid under it: the least fixed point of rules
that follow JSON Schema's meaning for `$ref`, `allOf`, `anyOf`, `oneOf`, `type`, `required`,
`properties`, `minItems`, `prefixItems` and `items`. Whatever these rules do not read counts as
productive, so a schema is refused only when it certainly loops.
"""

from __future__ import annotations

from collections import deque
from typing import Any
from urllib.parse import unquote

_UNKNOWN = object()  # a `$ref` that points outside the schema or nowhere: llguidance judges it
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


def loops_for_ever(schema: Any) -> bool:
    """True when no JSON document of finite length is valid under `schema`, for a `$ref` loop."""
    if not isinstance(schema, dict):
        return False
    nodes = _subschemas(schema)  # children before their parents
    productive: set[int] = set()
    dependents: dict[int, list[dict]] = {}
    for node in nodes:
        for needed in _needs(schema, node):
            dependents.setdefault(id(needed), []).append(node)
    queue, queued = deque(nodes), {id(n) for n in nodes}
    while queue:  # a node is looked at again only when one it needs became productive
        node = queue.popleft()
        queued.discard(id(node))
        if id(node) in productive or not _yields(schema, node, productive):
            continue
        productive.add(id(node))
        for waiting in dependents.get(id(node), ()):
            if id(waiting) not in productive and id(waiting) not in queued:
                queue.append(waiting)
                queued.add(id(waiting))
    return id(schema) not in productive


def _subschemas(schema: dict) -> list[dict]:
    """Every object in the schema, each after the objects inside it."""
    order, stack = [], [(schema, False)]
    while stack:
        value, done = stack.pop()
        if done:
            order.append(value)
            continue
        if isinstance(value, dict):
            stack.append((value, True))
            stack.extend((v, False) for v in value.values() if isinstance(v, dict | list))
        else:
            stack.extend((v, False) for v in value if isinstance(v, dict | list))
    return order


def _needs(root: dict, node: dict) -> list[dict]:
    """The schemas whose productivity `node`'s may depend on."""
    found = []
    target = _resolve(root, node.get("$ref"))
    if isinstance(target, dict):
        found.append(target)
    for key in ("allOf", "anyOf", "oneOf", "prefixItems", "items"):
        found += [s for s in _list(node.get(key)) if isinstance(s, dict)]
    for key in ("items", "additionalItems"):
        if isinstance(node.get(key), dict):
            found.append(node[key])
    properties = node.get("properties")
    if isinstance(properties, dict):
        found += [s for s in properties.values() if isinstance(s, dict)]
    return found


def _yields(root: dict, node: dict, productive: set[int]) -> bool:
    """Whether some finite document is valid under `node`, given the schemas known to be productive."""

    def ok(s: Any) -> bool:
        if isinstance(s, bool):
            return s
        return id(s) in productive if isinstance(s, dict) else True

    if "$ref" in node:
        target = _resolve(root, node["$ref"])
        if target is not _UNKNOWN and not ok(target):
            return False
    if not all(ok(s) for s in _list(node.get("allOf"))):
        return False
    for key in ("anyOf", "oneOf"):
        branches = _list(node.get(key))
        if branches and not any(ok(s) for s in branches):
            return False
    if "enum" in node or "const" in node:
        return True
    types = node.get("type", _TYPES)
    types = [types] if isinstance(types, str) else types if isinstance(types, list | tuple) else _TYPES
    return any(_type_yields(t, node, ok) for t in types)


def _type_yields(kind: Any, node: dict, ok) -> bool:
    if kind == "object":
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = [n for n in _list(node.get("required")) if isinstance(n, str)]
        return all(ok(properties.get(name, True)) for name in required)
    if kind == "array":
        least = node.get("minItems", 0)
        if not isinstance(least, int) or least <= 0:
            return True
        items = node.get("items", True)
        prefix = _list(node.get("prefixItems")) or _list(items)  # (a list of items: the older drafts')
        rest = node.get("additionalItems", True) if isinstance(items, list) else items
        return all(ok(s) for s in prefix[:least]) and (least <= len(prefix) or ok(rest))
    return True


def _resolve(root: dict, ref: Any) -> Any:
    """The schema a `$ref` within this schema points at ("#", "#/$defs/name"); _UNKNOWN for others."""
    if ref == "#":
        return root
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return _UNKNOWN
    value: Any = root
    for part in ref[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return _UNKNOWN
    return value


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []
