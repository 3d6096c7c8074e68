"""The one coded-error type: every exception of the package that carries a code is a
CodedError with the same ``code``, ``reason`` and ``str()`` it had."""

from __future__ import annotations

import pytest

from slurm_fiber.core.book.misses import Miss, MissCode
from slurm_fiber.core.runtime.trail import AdmitRefused
from slurm_fiber.errors import CodedError
from slurm_fiber.homes.grantdir import GrantDirRefused
from slurm_fiber.homes.kubernetes.home import DevicesUnknown
from slurm_fiber.homes.slurm.control import ControlPlaneError
from slurm_fiber.homes.slurm.home import DevicesRefused
from slurm_fiber.homes.slurm.names import SlurmParseError
from slurm_fiber.protocol.framing import FramingError
from slurm_fiber.protocol.validate import ApiError, ErrorCode


@pytest.mark.parametrize("err, code", [
    (GrantDirRefused("grantdir_unsafe", "r"), "grantdir_unsafe"),
    (SlurmParseError("invalid", "r"), "invalid"),
    (ControlPlaneError("timeout", "r"), "timeout"),
    (DevicesRefused("device_held", "r"), "device_held"),
    (DevicesUnknown("r"), "devices_unknown"),
    (FramingError("oversize", "r"), "oversize"),
    (ApiError(ErrorCode.BAD_REQUEST, "r", "argv"), "bad_request"),
    (AdmitRefused(Miss(MissCode.DENIED, "r")), "denied"),
])
def test_every_coded_exception_is_a_coded_error(err: CodedError, code: str) -> None:
    assert isinstance(err, CodedError)
    assert (err.code, err.reason, str(err), err.args) == (code, "r", "r", ("r",))


def test_a_parse_error_is_still_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"^bad$"):
        raise SlurmParseError("invalid", "bad")
