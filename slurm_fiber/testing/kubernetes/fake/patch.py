"""The three patch types the fake API server applies, with the real server's semantics.

``merge_patch`` is RFC 7386 (``application/merge-patch+json``): objects merge,
``null`` deletes a key, and every list is replaced wholesale.
``strategic_merge_patch`` (``application/strategic-merge-patch+json``) is the
same except for the lists Kubernetes declares mergeable: lists of objects
with a merge key (Pod conditions keyed by ``type``, containers by ``name``)
merge element by element, ``$patch: delete`` removes one element, and
primitive lists with the merge strategy (finalizers) take the union.
``json_patch`` is RFC 6902 (``application/json-patch+json``): add, remove,
replace, move, copy and test. Every function is pure: it returns a new
document and never changes its inputs. A patch the server would refuse
raises ``PatchError`` with a one-line reason.
"""

from __future__ import annotations

import copy
from typing import Any

# Lists the real API server merges under strategic-merge-patch, by path from
# the object's root, with the key that identifies one element (None: a list
# of primitives merged as a set). Every other list is replaced wholesale.
STRATEGIC_LISTS: dict[tuple[str, ...], str | None] = {
    ("status", "conditions"): "type",
    ("spec", "containers"): "name",
    ("spec", "volumes"): "name",
    ("spec", "resourceClaims"): "name",
    ("status", "resourceClaimStatuses"): "name",
    ("metadata", "ownerReferences"): "uid",
    ("metadata", "finalizers"): None,
}

SET_ELEMENT_ORDER = "$setElementOrder/"


class PatchError(ValueError):
    """A patch the server refuses (malformed, failed test, bad path)."""


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 merge of ``patch`` into ``target``; lists are replaced wholesale."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def strategic_merge_patch(target: Any, patch: Any, path: tuple[str, ...] = ()) -> Any:
    """Kubernetes strategic merge of ``patch`` into ``target`` at ``path`` from the root."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith(SET_ELEMENT_ORDER) or key == "$patch":
            continue  # ordering hints; the fake keeps the existing order
        if key.startswith("$"):
            raise PatchError(f"unsupported strategic merge directive {key!r}")
        here = (*path, key)
        if value is None:
            out.pop(key, None)
        elif isinstance(value, list) and here in STRATEGIC_LISTS:
            out[key] = _merge_list(out.get(key), value, STRATEGIC_LISTS[here], here)
        else:
            out[key] = strategic_merge_patch(out.get(key), value, here)
    return out


def _merge_list(
    current: Any, patch: list[Any], merge_key: str | None, path: tuple[str, ...]
) -> list[Any]:
    existing = list(current) if isinstance(current, list) else []
    if merge_key is None:
        return existing + [copy.deepcopy(v) for v in patch if v not in existing]
    merged = [copy.deepcopy(item) for item in existing]
    for item in patch:
        if not isinstance(item, dict) or merge_key not in item:
            raise PatchError(f"{'.'.join(path)}: every element needs its merge key {merge_key!r}")
        where = next(
            (i for i, old in enumerate(merged) if old.get(merge_key) == item[merge_key]), None
        )
        if item.get("$patch") == "delete":
            if where is not None:
                del merged[where]
        elif where is None:
            merged.append(strategic_merge_patch({}, item, path))
        else:
            merged[where] = strategic_merge_patch(merged[where], item, path)
    return merged


def json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902: apply ``operations`` in order; any failure refuses the whole patch."""
    if not isinstance(operations, list):
        raise PatchError("a JSON patch is a list of operations")
    doc = copy.deepcopy(target)
    for op in operations:
        if not isinstance(op, dict) or not isinstance(op.get("path"), str):
            raise PatchError("each JSON patch operation needs an 'op' and a string 'path'")
        doc = _apply_op(doc, op)
    return doc


def _apply_op(doc: Any, op: dict[str, Any]) -> Any:
    kind = op.get("op")
    path = op["path"]
    if kind == "add":
        return _put(doc, path, copy.deepcopy(_value(op)), insert=True)
    if kind == "remove":
        _take(doc, path)
        return doc
    if kind == "replace":
        _get(doc, path)
        return _put(doc, path, copy.deepcopy(_value(op)), insert=False)
    if kind in {"move", "copy"}:
        source = op.get("from")
        if not isinstance(source, str):
            raise PatchError(f"{kind} needs a string 'from'")
        value = _take(doc, source) if kind == "move" else copy.deepcopy(_get(doc, source))
        return _put(doc, path, value, insert=True)
    if kind == "test":
        if _get(doc, path) != _value(op):
            raise PatchError(f"test failed at {path}")
        return doc
    raise PatchError(f"unknown JSON patch op {kind!r}")


def _value(op: dict[str, Any]) -> Any:
    if "value" not in op:
        raise PatchError(f"{op.get('op')} at {op['path']} needs a 'value'")
    return op["value"]


def _tokens(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"JSON pointer {path!r} must start with '/'")
    return [t.replace("~1", "/").replace("~0", "~") for t in path[1:].split("/")]


def _index(container: list[Any], token: str, path: str, *, end_ok: bool) -> int:
    if end_ok and token == "-":
        return len(container)
    if not token.isdigit():
        raise PatchError(f"{path}: {token!r} is not a list index")
    index = int(token)
    if index > len(container) or (index == len(container) and not end_ok):
        raise PatchError(f"{path}: index {index} out of range")
    return index


def _parent(doc: Any, path: str) -> tuple[Any, str]:
    tokens = _tokens(path)
    if not tokens:
        raise PatchError("the document root cannot be the target here")
    node = doc
    for token in tokens[:-1]:
        node = _step(node, token, path)
    return node, tokens[-1]


def _step(node: Any, token: str, path: str) -> Any:
    if isinstance(node, dict) and token in node:
        return node[token]
    if isinstance(node, list):
        return node[_index(node, token, path, end_ok=False)]
    raise PatchError(f"{path}: no such member {token!r}")


def _get(doc: Any, path: str) -> Any:
    node = doc
    for token in _tokens(path):
        node = _step(node, token, path)
    return node


def _put(doc: Any, path: str, value: Any, *, insert: bool) -> Any:
    if not _tokens(path):
        return value
    parent, last = _parent(doc, path)
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        index = _index(parent, last, path, end_ok=insert)
        if insert:
            parent.insert(index, value)
        else:
            parent[index] = value
    else:
        raise PatchError(f"{path}: parent is not an object or a list")
    return doc


def _take(doc: Any, path: str) -> Any:
    parent, last = _parent(doc, path)
    if isinstance(parent, dict) and last in parent:
        return parent.pop(last)
    if isinstance(parent, list):
        return parent.pop(_index(parent, last, path, end_ok=False))
    raise PatchError(f"{path}: nothing to remove")
