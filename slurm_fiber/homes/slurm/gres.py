"""The device files of a node's GPUs, read from a gres.conf-style file.

Slurm numbers a node's GPUs (the indices in SLURM_JOB_GPUS) in the order
its gres.conf lists their files for that node, so GPU i's device file is the
i-th ``File=`` entry of the ``Name=gpu`` lines that apply to the node (lines
with no ``NodeName=``, or whose NodeName hostlist names it). Pure; hostile
text raises SlurmParseError. Lines this does not understand (AutoDetect,
Count-only lines, comments) are skipped.
"""

from __future__ import annotations

from slurm_fiber.homes.slurm.scontrol import expand_hostlist

MAX_GRES_CONF = 1 << 20


def _pairs(line: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for word in line.split():
        key, sep, value = word.partition("=")
        if sep:
            pairs[key.lower()] = value
    return pairs


def gpu_files(text: str, node: str) -> dict[int, str]:
    """GPU index → device file path on ``node`` from gres.conf ``text``; {} when none listed.

    Raises SlurmParseError for a malformed hostlist in NodeName= or File=.
    """
    files: list[str] = []
    for raw in text[:MAX_GRES_CONF].splitlines():
        pairs = _pairs(raw.split("#", 1)[0])
        if pairs.get("name") != "gpu" or "file" not in pairs:
            continue
        if "nodename" in pairs and node not in expand_hostlist(pairs["nodename"]):
            continue
        files.extend(expand_hostlist(pairs["file"]))
    return dict(enumerate(files))
