"""The ``fiber`` claim in JSON: strict parsing into FiberSpec, and back.

``parse_fiber_spec`` is the one place a token's (or a saved state's) ``fiber``
object becomes a ``FiberSpec``. It is strict on purpose: an unknown member, a
wrong type, a limit outside its range (``LIMIT_RANGES``) or a malformed module
name is refused with ``BadFiberClaim`` (a one-line reason naming the member),
because a typo such as ``"fibres"`` silently meaning "unlimited" would be worse
than a refusal. A claim is hostile input (it is parsed before the signature is
checked): no value, however large (``10**400``), non-finite or oddly typed
(``true``), makes parsing raise anything but ``BadFiberClaim``;
``number_in_range`` is the one range check, shared with the token's times, and
it compares exactly, never converting a huge integer to a float.
``fiber_spec_to_json`` is its inverse: ``parse_fiber_spec(fiber_spec_to_json(s)) == s``.
"""

from __future__ import annotations

import math
import re
from typing import Any

from slurm_fiber.core.trust.grant import FiberSpec, Limits, TemplateSpec

_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DEVICE_KIND = re.compile(r"[a-z][a-z0-9_-]{0,31}")
_INT_LIMITS = ("fibers", "memory", "pids")
_FLOAT_LIMITS = ("cpu", "seconds")

# The largest value each limit may take: what the kernel (or the runtime) can apply.
LIMIT_RANGES: dict[str, int] = {
    "fibers": 1 << 20,  # concurrent fibers; far beyond what pids allow anyway
    "memory": (1 << 63) - 1,  # bytes: memory.max is read as a 64-bit number
    "pids": 1 << 22,  # PID_MAX_LIMIT on 64-bit Linux; pids.max refuses more
    "cpu": 1 << 20,  # CPUs: the cpu.max quota stays far below the kernel's 2**44 µs
    "seconds": 1_000_000_000,  # about 31 years
}


# The least each limit may be where a template must start under it: a grant below it
# could never warm (a ``memory`` of 1 byte answered ``cold`` for ever, its cgroup kept).
# CPython and the template's own modules take about 15 MB; page cache is charged too.
LIMIT_FLOORS: dict[str, int] = {
    "memory": 32 << 20,
    "pids": 2,  # the template and one fiber
}


class BadFiberClaim(ValueError):
    """The ``fiber`` claim is not a valid grant; ``str(err)`` is a one-line reason."""


def parse_fiber_spec(obj: object, *, floors: bool = True) -> FiberSpec:
    """Parse a decoded ``fiber`` claim. Pure; raises BadFiberClaim on any defect, and on
    a limit below its floor (``LIMIT_FLOORS``) unless ``floors`` is off (a saved state
    admitted before the floors: it is read, not judged again)."""
    top = _object(obj, "fiber", {"template", "limits", "devices"})
    devices = _str_list(top.get("devices", []), "fiber.devices", _DEVICE_KIND, "a device kind")
    limits = _limits(top.get("limits", {}))
    if floors:
        for name, low in LIMIT_FLOORS.items():
            value = getattr(limits, name)
            if value is not None and value < low:
                raise BadFiberClaim(f"fiber.limits.{name} is {value}, below {low}: a "
                                    "template cannot start under less; ask for more")
    return FiberSpec(template=_template(top.get("template", {})), limits=limits,
                     devices=devices)


def fiber_spec_to_json(spec: FiberSpec) -> dict[str, Any]:
    """The JSON form of ``spec`` (only members that are set), as a token carries it."""
    template: dict[str, Any] = {}
    if spec.template.preload:
        template["preload"] = list(spec.template.preload)
    if spec.template.warm is not None:
        template["warm"] = spec.template.warm
    if spec.template.env:
        template["env"] = dict(spec.template.env)
    limits = {
        name: getattr(spec.limits, name)
        for name in (*_INT_LIMITS, *_FLOAT_LIMITS)
        if getattr(spec.limits, name) is not None
    }
    out: dict[str, Any] = {}
    if template:
        out["template"] = template
    if limits:
        out["limits"] = limits
    if spec.devices:
        out["devices"] = list(spec.devices)
    return out


def _template(obj: object) -> TemplateSpec:
    t = _object(obj, "fiber.template", {"preload", "warm", "env"})
    preload = _str_list(t.get("preload", []), "fiber.template.preload", _MODULE, "a module name")
    warm = t.get("warm")
    if warm is not None:
        module, sep, func = warm.partition(":") if isinstance(warm, str) else ("", "", "")
        if not (sep and _MODULE.fullmatch(module) and _MODULE.fullmatch(func)):
            raise BadFiberClaim("fiber.template.warm must be 'module:function'")
    env = _object(t.get("env", {}), "fiber.template.env", None)
    for name, value in env.items():
        if not _ENV_NAME.fullmatch(name):
            raise BadFiberClaim(f"fiber.template.env: {name!r} is not a variable name")
        if not isinstance(value, str) or "\0" in value:
            raise BadFiberClaim(f"fiber.template.env.{name} must be a string without NUL")
    return TemplateSpec(preload=preload, warm=warm, env=dict(env))


def number_in_range(value: object, low: float, high: float, *, integer: bool,
                    low_open: bool = False) -> bool:
    """Whether ``value`` is a JSON number (not a bool) in [low, high] (or (low, high]).

    ``integer`` accepts only ints. Never raises: a huge int is compared
    exactly with the bounds (Python compares int and float without
    converting), and NaN or an infinity is never in range.
    """
    if isinstance(value, bool) or not isinstance(value, int if integer else int | float):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return (low < value if low_open else low <= value) and value <= high


def _limits(obj: object) -> Limits:
    raw = _object(obj, "fiber.limits", {*_INT_LIMITS, *_FLOAT_LIMITS})
    values: dict[str, int | float] = {}
    for name, value in raw.items():
        is_int = name in _INT_LIMITS
        high = LIMIT_RANGES[name]
        if not number_in_range(value, 0, high, integer=is_int, low_open=True):
            kind = "a positive integer" if is_int else "a positive number"
            raise BadFiberClaim(f"fiber.limits.{name} must be {kind} of at most {high}")
        values[name] = value if is_int else float(value)
    return Limits(**values)  # type: ignore[arg-type]


def _object(obj: object, where: str, allowed: set[str] | None) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise BadFiberClaim(f"{where} must be an object")
    if allowed is not None:
        unknown = sorted(set(obj) - allowed)
        if unknown:
            raise BadFiberClaim(f"{where} has unknown member {unknown[0]!r}")
    return obj


def _str_list(obj: object, where: str, pattern: re.Pattern[str], what: str) -> tuple[str, ...]:
    if not isinstance(obj, list) or not all(
        isinstance(s, str) and pattern.fullmatch(s) for s in obj
    ):
        raise BadFiberClaim(f"{where} must be a list of strings, each {what}")
    if len(set(obj)) != len(obj):
        raise BadFiberClaim(f"{where} lists an entry twice")
    return tuple(obj)
