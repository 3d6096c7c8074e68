"""fiberd's configuration: precedence, validation with the source named, typo safety."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

import slurm_fiber.config as config_module
from slurm_fiber.config import OPTIONS, ConfigError, FiberdConfig, describe, load_config
from slurm_fiber.core.clock import FakeClock
from slurm_fiber.core.devices import Device
from slurm_fiber.core.trust.grant import FiberSpec, VerifiedToken
from slurm_fiber.homes.select import load_config as homes_load_config
from slurm_fiber.homes.standalone import StandaloneHome
from tests.homes.homekit import token


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "fiberd.toml"
    path.write_text(text)
    return str(path)


def refusal(**kw: object) -> ConfigError:
    """The refusal of loading ``kw`` as fiberd does (every home's own options known)."""
    with pytest.raises(ConfigError) as err:
        homes_load_config(**kw)
    assert "\n" not in str(err.value)
    return err.value


def test_defaults_derive_every_path_from_the_state_dir() -> None:
    config = load_config(env={})
    assert config == FiberdConfig(
        socket="/var/lib/slurm-fiber/fiberd.sock",
        audit_path="/var/lib/slurm-fiber/audit.jsonl",
        grantdir="/var/lib/slurm-fiber/grants",
        ready_file="/var/lib/slurm-fiber/ready.json",
    )
    moved = load_config(env={"FIBERD_STATE_DIR": "/srv/f"})
    assert (moved.socket, moved.grantdir) == ("/srv/f/fiberd.sock", "/srv/f/grants")


def test_file_then_environment_then_flags_each_win_over_the_one_before(tmp_path: Path) -> None:
    path = write(tmp_path, 'poll_interval = 2\nleeway = 10\ngrace = 1\nhome = "slurm"\n')
    env = {"FIBERD_LEEWAY": "20", "FIBERD_GRACE": "2"}
    config = load_config(path, env, {"grace": 3.5, "poll_interval": None})
    assert (config.poll_interval, config.leeway, config.grace) == (2.0, 20.0, 3.5)
    assert config.home == "slurm"


def test_the_config_file_may_come_from_the_environment(tmp_path: Path) -> None:
    path = write(tmp_path, "poll_interval = 7\n")
    assert load_config(env={"FIBERD_CONFIG": path}).poll_interval == 7.0


def test_relative_paths_are_taken_from_the_file_or_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, 'grantdir = "g"\n[trust]\n"https://issuer.example" = "keys/jwks.json"\n')
    monkeypatch.chdir("/tmp")
    config = load_config(path, {"FIBERD_SOCKET": "run/f.sock"})
    assert config.grantdir == str(tmp_path / "g")
    assert dict(config.trust) == {"https://issuer.example": str(tmp_path / "keys/jwks.json")}
    assert config.socket == "/tmp/run/f.sock"


def test_list_options_from_toml_arrays_and_comma_separated_text(tmp_path: Path) -> None:
    path = write(tmp_path, 'devices = ["gpu:1:/dev/nvidia1", "gpu:0:/dev/nvidia0:GPU-abc"]\n'
                           'allowed_uids = [1000, "root"]\n')
    config = load_config(path, {"FIBERD_ALLOWED_GIDS": "0, 5",
                                "FIBERD_TRUST": "a=/k/a.json,https://b/?x=1=/k/b.json"})
    assert config.devices == (Device("gpu", 1, "/dev/nvidia1"),
                              Device("gpu", 0, "/dev/nvidia0", "GPU-abc"))
    assert config.allowed_uids == (0, 1000)
    assert config.allowed_gids == (0, 5)
    assert dict(config.trust) == {"a": "/k/a.json", "https://b/?x=1": "/k/b.json"}
    flagged = load_config(env={}, flags={"devices": ("fpga:0",), "allowed_uids": ("7",)})
    assert flagged.devices == (Device("fpga", 0),)
    assert flagged.allowed_uids == (7,)


def test_spares_come_from_any_source_as_a_count(tmp_path: Path) -> None:
    assert load_config(env={}).spares == 2
    assert load_config(write(tmp_path, "spares = 0\n"), {}).spares == 0
    assert load_config(env={"FIBERD_SPARES": "4"}).spares == 4
    assert load_config(env={}, flags={"spares": "16"}).spares == 16


def test_spares_idle_is_seconds_and_zero_keeps_them() -> None:
    assert load_config(env={}).spares_idle == 300
    assert load_config(env={"FIBERD_SPARES_IDLE": "0"}).spares_idle == 0
    assert load_config(env={}, flags={"spares_idle": "2.5"}).spares_idle == 2.5


def test_metrics_are_off_by_default_and_listen_on_loopback_unless_a_host_is_named(
        tmp_path: Path) -> None:
    config = load_config(env={})
    assert config.metrics_listen is None and config.metrics_textfile is None
    assert load_config(env={"FIBERD_METRICS_LISTEN": "9464"}).metrics_listen == \
        ("127.0.0.1", 9464) == load_config(write(tmp_path, "metrics_listen = 9464\n"),
                                           {}).metrics_listen
    assert load_config(env={}, flags={"metrics_listen": "[::1]:80"}).metrics_listen == \
        ("::1", 80)
    filed = load_config(write(tmp_path, 'metrics_listen = "node7.example:9464"\n'
                                        'metrics_textfile = "prom"\n'), {})
    assert filed.metrics_listen == ("node7.example", 9464)
    assert filed.metrics_textfile == str(tmp_path / "prom")


def test_none_switches_off_optional_things() -> None:
    config = load_config(env={"FIBERD_READY_FILE": "none", "FIBERD_CGROUP_ROOT": "None"})
    assert config.ready_file is None and config.cgroup_root is None
    assert load_config(env={"FIBERD_CGROUP_ROOT": "/sys/fs/cgroup/x"}).cgroup_root == \
        "/sys/fs/cgroup/x"


@pytest.mark.parametrize(
    ("toml", "option", "says"),
    [
        ("poll_interval = -1\n", "poll_interval", "must be positive seconds"),
        ("poll_interval = 0\n", "poll_interval", "must be positive seconds"),
        ('poll_interval = "soon"\n', "poll_interval", "must be a number of seconds"),
        ("leeway = 301\n", "leeway", "between 0 and 300"),
        ("grace = true\n", "grace", "must be a number of seconds"),
        ('home = "Slurm M"\n', "home", "must be a home's name"),
        ('devices = ["gpu:x"]\n', "devices", "kind:index[:path[:uuid]]"),
        ('devices = ["gpu:0:dev/nvidia0"]\n', "devices", "path must be absolute"),
        ('devices = ["gpu:0", "gpu:0:/dev/nvidia0"]\n', "devices", "listed twice"),
        ('allowed_uids = ["no-such-user-here"]\n', "allowed_uids", "no user named"),
        ("allowed_gids = [-1]\n", "allowed_gids", "is not a group id"),
        ('socket = ""\n', "socket", "empty string"),
        ("audience = 5\n", "audience", "must be a string"),
        ("trust = 5\n", "trust", "must be a list"),
        ('ready_condition = "has space"\n', "ready_condition", "qualified name"),
        ('ready_condition = "a/b/c"\n', "ready_condition", "qualified name"),
        ('ready_condition = "Upper.example/x"\n', "ready_condition", "qualified name"),
        ('ready_condition = "x-"\n', "ready_condition", "qualified name"),
        ("spares = 17\n", "spares", "whole number from 0 to 16"),
        ("spares = -1\n", "spares", "whole number from 0 to 16"),
        ("spares = 1.5\n", "spares", "whole number from 0 to 16"),
        ("spares = true\n", "spares", "whole number from 0 to 16"),
        ('metrics_listen = "127.0.0.1:0"\n', "metrics_listen", "from 1 to 65535"),
        ('metrics_listen = ":9464"\n', "metrics_listen", "names no host"),
        ('metrics_listen = "::1:9464"\n', "metrics_listen", "IPv6: [ADDR]:PORT"),
        ('metrics_listen = "[x]:9464"\n', "metrics_listen", "is not an IPv6 address"),
        ("metrics_listen = true\n", "metrics_listen", "must be a string"),
    ],
)
def test_a_bad_file_value_names_the_option_and_file_key(
    tmp_path: Path, toml: str, option: str, says: str
) -> None:
    path = write(tmp_path, toml)
    err = refusal(path=path, env={})
    assert (err.option, err.source) == (option, f"{path}:{option}")
    assert says in err.reason
    assert str(err).startswith(f"{option} (from {path}:{option}): ")


def test_a_bad_environment_or_flag_value_names_its_variable_or_flag() -> None:
    err = refusal(env={"FIBERD_POLL_INTERVAL": "abc"})
    assert (err.option, err.source) == ("poll_interval", "FIBERD_POLL_INTERVAL")
    err = refusal(env={}, flags={"trust": "no-equals-sign"})
    assert (err.option, err.source) == ("trust", "--trust")
    assert "issuer=/path/to/jwks.json" in err.reason


def test_unknown_keys_variables_and_flags_are_refused_with_a_suggestion(tmp_path: Path) -> None:
    err = refusal(path=write(tmp_path, "pol_interval = 1\n"), env={})
    assert err.reason == "is not a fiberd option; did you mean poll_interval?"
    err = refusal(env={"FIBERD_GRANT_DIR": "/g"})
    assert err.option == "FIBERD_GRANT_DIR" and "did you mean FIBERD_GRANTDIR?" in err.reason
    err = refusal(env={}, flags={"colour": "red"})
    assert err.source == "the command line" and err.reason == "is not a fiberd option"


def test_an_unreadable_or_invalid_file_is_refused(tmp_path: Path) -> None:
    assert "cannot read the file" in refusal(path=str(tmp_path / "missing.toml"), env={}).reason
    assert "is not valid TOML" in refusal(path=write(tmp_path, "x = = 1\n"), env={}).reason


def test_the_ready_condition_is_a_kubernetes_condition_type() -> None:
    def condition(env: dict[str, str]) -> object:
        return homes_load_config(env=env).home_options["ready_condition"]

    assert condition({}) == "slurm-fiber.io/template-warm"
    for good in ("Ready", "example.com/grant.warm_1", "a.b-c.d/X"):
        assert condition({"FIBERD_READY_CONDITION": good}) == good
    assert refusal(env={"FIBERD_READY_CONDITION": "x" * 64}).option == "ready_condition"


def test_a_home_option_is_the_homes_not_in_fiberds_table() -> None:
    """ready_condition is declared by the kubernetes home (homes/kubernetes/options.py):
    fiberd's own table knows it not, fiberd's flags and --help do, from the home."""
    from slurm_fiber.cli.fiberd_options import option_parameters

    assert "ready_condition" not in [opt.name for opt in OPTIONS]
    with pytest.raises(ConfigError, match="is not a fiberd option"):
        load_config(env={"FIBERD_READY_CONDITION": "Ready"})
    flags = {p.name: p.default for p in option_parameters()}
    assert "FIBERD_READY_CONDITION" in flags["ready_condition"].help
    assert homes_load_config(env={}, flags={"ready_condition": "x.io/w"}).home_options == {
        "ready_condition": "x.io/w"}


def test_fence_ttl_may_not_be_shorter_than_stale_ttl() -> None:
    err = refusal(env={"FIBERD_FENCE_TTL": "30"})
    assert (err.option, err.source) == ("fence_ttl", "FIBERD_FENCE_TTL")
    assert "must not be shorter than stale_ttl (60 s)" in err.reason


def test_every_option_is_a_field_documented_in_the_docstring_and_describe() -> None:
    names = [opt.name for opt in OPTIONS]
    assert [*names, "home_options"] == list(FiberdConfig.__match_args__)  # its fields
    doc = config_module.__doc__ or ""
    text = describe()
    for opt in OPTIONS:
        assert f"| {opt.name} |" in doc
        assert opt.flag in text and opt.env in text


def test_the_configuration_builds_a_standalone_home(
    tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    path = write(tmp_path, f'state_dir = "{tmp_path}"\ndevices = ["gpu:0", "fpga:0"]\n'
                           'cgroup_root = "none"\npoll_interval = 3\n')
    home = StandaloneHome.from_config(load_config(path, {}), clock)
    os.mkdir(tmp_path / "grants", 0o755)
    vt = VerifiedToken("g", "i", "j", ("a",), 0.0, 0.0, None, FiberSpec(devices=("gpu",)), b"")

    async def main() -> None:
        channel, _ = await home.devices(vt)
        assert channel.devices == (Device("gpu", 0),)
        await home.publish_ready("g", True)
        events = await home.grants()
        pending = asyncio.ensure_future(anext(events))
        await clock.settle()
        (tmp_path / "grants" / "g.jwt").write_bytes(token("g"))
        await clock.advance_and_settle(2.9)
        assert not pending.done()  # the configured interval, not the default
        await clock.advance_and_settle(0.1)
        assert (await pending).token == token("g")
        await events.aclose()

    asyncio.run(main())
    assert json.loads((tmp_path / "ready.json").read_text())["warm"] == ["g"]
    assert home.cgroup_root() is None and "uncarved" in home.cgroup_reason()


def test_strict_limits_is_a_switch_from_any_source(tmp_path: Path) -> None:
    assert load_config(env={}).strict_limits is False
    toml = tmp_path / "f.toml"
    toml.write_text("strict_limits = true\n")
    assert load_config(str(toml), env={}).strict_limits is True
    assert load_config(str(toml), env={"FIBERD_STRICT_LIMITS": "no"}).strict_limits is False
    assert load_config(env={"FIBERD_STRICT_LIMITS": "1"}, flags={"strict_limits": False}
                       ).strict_limits is False
    with pytest.raises(ConfigError, match=r"FIBERD_STRICT_LIMITS.*true or false"):
        load_config(env={"FIBERD_STRICT_LIMITS": "maybe"})
