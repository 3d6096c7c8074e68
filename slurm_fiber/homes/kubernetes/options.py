"""The Kubernetes home's own fiberd options, declared as fiberd's own are (``config.Option``).

``OPTIONS`` is what the home's registry entry declares (``HomeEntry.own_options``):
fiberd takes them from the file, the environment and the flags like any other,
refuses a bad value in one line naming the option and its source, lists them in
``fiberd --help`` and the man page, and keeps their values in
``FiberdConfig.home_options``. Pure; imports only the configuration module.
"""

from __future__ import annotations

import re

from slurm_fiber.config import Option, OptionRefused, text_value

READY_CONDITION = "ready_condition"
DEFAULT_CONDITION = "slurm-fiber.io/template-warm"
_CONDITION_TYPE = re.compile(
    r"^(?:(?=[^/]{1,253}/)[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*/)?"
    r"(?=[^/]{1,63}$)[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)


def condition_type(value: object) -> str:
    """A Kubernetes condition type: a qualified name, ``[dns.prefix/]name``."""
    text = text_value(value)
    if not _CONDITION_TYPE.match(text):
        raise OptionRefused(
            f"must be a Kubernetes qualified name like example.com/ready, got {value!r}")
    return text


OPTIONS = (
    Option(READY_CONDITION, condition_type,
           "kubernetes home: the Pod condition type its readiness gate names",
           default=DEFAULT_CONDITION),
)
