"""The syntax of names a request carries that other parts of slurm_fiber also read.

A grant UID (docs/design.md §3: what a token's ``uid`` claim and a clone's ``grant``
field must look like) and the device visibility variables, which the grant's devices
set and a request's ``env`` may never name (core/devices.py sets them per kind).
"""

from __future__ import annotations

import re

UID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")

# Every vendor's variable that shows a GPU, since which runtime an engine uses is not known.
GPU_VISIBILITY_VARS: tuple[str, ...] = (
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "GPU_DEVICE_ORDINAL",
    "ZE_AFFINITY_MASK",
)


def valid_uid(uid: object) -> bool:
    """Whether ``uid`` is a string matching the grant UID pattern of DESIGN §3."""
    return isinstance(uid, str) and UID_PATTERN.fullmatch(uid) is not None
