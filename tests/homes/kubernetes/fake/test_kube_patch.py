"""The fake server's patch semantics match the real API server's for the three patch types."""

from __future__ import annotations

import pytest

from slurm_fiber.testing.kubernetes.fake.patch import (
    PatchError,
    json_patch,
    merge_patch,
    strategic_merge_patch,
)

POD = {
    "metadata": {"name": "p", "labels": {"a": "1", "b": "2"}, "finalizers": ["x"]},
    "status": {
        "phase": "Running",
        "conditions": [
            {"type": "Ready", "status": "False"},
            {"type": "gate", "status": "False", "reason": "Cold"},
        ],
    },
}


def test_merge_patch_replaces_lists_and_deletes_with_null() -> None:
    out = merge_patch(POD, {"metadata": {"labels": {"a": None, "c": "3"}},
                            "status": {"conditions": [{"type": "gate", "status": "True"}]}})
    assert out["metadata"]["labels"] == {"b": "2", "c": "3"}
    assert out["status"]["conditions"] == [{"type": "gate", "status": "True"}]
    assert out["status"]["phase"] == "Running"
    assert POD["status"]["conditions"][1]["status"] == "False", "input untouched"


def test_strategic_merge_keeps_other_conditions_and_merges_by_type() -> None:
    out = strategic_merge_patch(POD, {"status": {"conditions": [
        {"type": "gate", "status": "True", "reason": None},
        {"type": "New", "status": "True"},
    ]}})
    assert out["status"]["conditions"] == [
        {"type": "Ready", "status": "False"},
        {"type": "gate", "status": "True"},
        {"type": "New", "status": "True"},
    ]


def test_strategic_merge_directives() -> None:
    out = strategic_merge_patch(POD, {
        "$setElementOrder/conditions": [{"type": "gate"}, {"type": "Ready"}],
        "status": {"conditions": [{"type": "Ready", "$patch": "delete"}]},
        "metadata": {"finalizers": ["y", "x"]},
    })
    assert [c["type"] for c in out["status"]["conditions"]] == ["gate"]
    assert out["metadata"]["finalizers"] == ["x", "y"], "finalizers merge as a set"
    replaced = strategic_merge_patch(POD, {"status": {"$patch": "replace", "phase": "Failed"}})
    assert replaced["status"] == {"phase": "Failed"}


@pytest.mark.parametrize("patch", [
    {"status": {"conditions": [{"status": "True"}]}},
    {"$retainKeys": ["a"]},
])
def test_strategic_merge_refuses_what_the_server_refuses(patch: dict) -> None:
    with pytest.raises(PatchError):
        strategic_merge_patch(POD, patch)


def test_json_patch_ops() -> None:
    out = json_patch(POD, [
        {"op": "test", "path": "/status/phase", "value": "Running"},
        {"op": "replace", "path": "/status/conditions/1/status", "value": "True"},
        {"op": "add", "path": "/status/conditions/-", "value": {"type": "New", "status": "True"}},
        {"op": "remove", "path": "/metadata/labels/a"},
        {"op": "copy", "from": "/metadata/labels/b", "path": "/metadata/labels/c"},
        {"op": "move", "from": "/metadata/labels/b", "path": "/metadata/labels/d~1e"},
    ])
    assert [c["status"] for c in out["status"]["conditions"]] == ["False", "True", "True"]
    assert out["metadata"]["labels"] == {"c": "2", "d/e": "2"}


@pytest.mark.parametrize("ops", [
    [{"op": "test", "path": "/status/phase", "value": "Pending"}],
    [{"op": "remove", "path": "/nope"}],
    [{"op": "replace", "path": "/status/conditions/9", "value": 1}],
    [{"op": "add", "path": "status", "value": 1}],
    [{"op": "jump", "path": "/status"}],
    [{"op": "add", "path": "/status/x"}],
    {"op": "add"},
])
def test_json_patch_refusals_change_nothing(ops: object) -> None:
    with pytest.raises(PatchError):
        json_patch(POD, ops)
    assert POD["status"]["phase"] == "Running"
