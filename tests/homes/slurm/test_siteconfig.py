"""The site config: defaults, every key, relative paths, and one-line refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_fiber.homes.slurm.paths import DEFAULT_STATE_ROOT
from slurm_fiber.homes.slurm.siteconfig import (
    DEFAULT_CONFIG,
    SiteConfigError,
    config_path,
    fatal_checks,
    load_site_config,
)

FULL = """
issuer = "citest"
issuer_key = "keys/citest.key"
state_root = "/srv/sf"
spool_dir = "/var/spool/sf"
gres_conf = "/etc/slurm/gres.conf"
delegate_cgroup = true
cgroup_parent = "/sys/fs/cgroup/sf"
publish_comment = true
fatal = ["config", "leases"]
step_seconds = 1.5
lease_ttl = 3600
token_lifetime = 7200

[trust]
citest = "keys/citest.jwks.json"
"https://cp.example/" = "/etc/cp.jwks"

[grant]
devices = ["gpu"]
template = { preload = ["json"], warm = "json:dumps" }
limits = { fibers = 4, memory = 1073741824, seconds = 60 }
"""


def write(tmp_path: Path, text: str) -> dict[str, str]:
    path = tmp_path / "site.toml"
    path.write_text(text)
    return {"SLURM_FIBER_CONFIG": str(path)}


def test_an_absent_default_file_is_all_defaults() -> None:
    assert config_path({}) == (DEFAULT_CONFIG, False)
    if Path(DEFAULT_CONFIG).exists():
        pytest.skip(f"{DEFAULT_CONFIG} exists on this machine")
    config = load_site_config({})
    assert config.source is None and config.state_root == DEFAULT_STATE_ROOT
    assert config.issuer_key is None and not config.delegate_cgroup and config.fatal == set()


def test_every_key(tmp_path: Path) -> None:
    config = load_site_config(write(tmp_path, FULL))
    assert config.issuer == "citest"
    assert config.issuer_key == tmp_path / "keys/citest.key"  # relative to the file
    assert dict(config.trust) == {"citest": tmp_path / "keys/citest.jwks.json",
                                  "https://cp.example/": Path("/etc/cp.jwks")}
    assert config.state_root == Path("/srv/sf") and config.spool_dir == Path("/var/spool/sf")
    assert config.delegate_cgroup and config.cgroup_parent == Path("/sys/fs/cgroup/sf")
    assert config.publish_comment and config.is_fatal("leases") and not config.is_fatal("job")
    assert (config.step_seconds, config.lease_ttl, config.token_lifetime) == (1.5, 3600, 7200)
    assert config.grant.devices == ("gpu",) and config.grant.template.warm == "json:dumps"
    assert config.grant.limits.fibers == 4 and config.grant.limits.seconds == 60


def test_the_state_root_variable_wins(tmp_path: Path) -> None:
    env = write(tmp_path, FULL) | {"SLURM_FIBER_STATE_ROOT": "/elsewhere"}
    assert load_site_config(env).state_root == Path("/elsewhere")
    with pytest.raises(SiteConfigError, match="must be an absolute path"):
        load_site_config(env | {"SLURM_FIBER_STATE_ROOT": "relative"})


@pytest.mark.parametrize(("text", "message"), [
    ("issuer = ", "not valid TOML"),
    ("isuer = 'x'", "unknown key 'isuer'"),
    ("fatal = ['tokens', 'nodes']", r"fatal: names unknown checks \['nodes'\]"),
    ("fatal = 'config'", "fatal: must be a list"),
    ("step_seconds = 0", "step_seconds: must be between"),
    ("step_seconds = true", "step_seconds: must be a number"),
    ("delegate_cgroup = 'yes'", "delegate_cgroup: must be true or false"),
    ("issuer = 'a b'", "issuer: must be a name"),
    ("state_root = ''", "state_root: must be a non-empty path"),
    ("[grant]\nfibres = 3", "grant: .*fibres"),
    ("[grant]\nlimits = { fibers = -1 }", "grant: .*fibers"),
    ("issuer_key = '/k'", "issuer_key is set but issuer is not"),
    ("[trust]\nx = 3", "trust: must be a non-empty path"),
])
def test_refusals_are_one_line_naming_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(SiteConfigError, match=message) as err:
        load_site_config(write(tmp_path, text))
    assert "\n" not in str(err.value) and str(tmp_path / "site.toml") in str(err.value)


def test_a_named_file_must_exist_and_be_absolute(tmp_path: Path) -> None:
    with pytest.raises(SiteConfigError, match="no such file"):
        load_site_config({"SLURM_FIBER_CONFIG": str(tmp_path / "missing.toml")})
    with pytest.raises(SiteConfigError, match="absolute"):
        load_site_config({"SLURM_FIBER_CONFIG": "site.toml"})
    (tmp_path / "binary.toml").write_bytes(b"\xff\xfe")
    with pytest.raises(SiteConfigError, match="not valid TOML"):
        load_site_config({"SLURM_FIBER_CONFIG": str(tmp_path / "binary.toml")})


def test_fatal_checks_survive_a_broken_key(tmp_path: Path) -> None:
    env = write(tmp_path, "fatal = ['config']\nstep_seconds = 'soon'\n")
    with pytest.raises(SiteConfigError):
        load_site_config(env)
    assert fatal_checks(env) == {"config"}
    assert fatal_checks(write(tmp_path, "fatal = [")) == set()  # unreadable: never fatal
    assert fatal_checks({"SLURM_FIBER_CONFIG": str(tmp_path / "none.toml")}) == set()


def test_the_contrib_example_is_a_valid_site_config() -> None:
    example = Path(__file__).resolve().parents[3] / "contrib" / "slurm.conf.d" / "slurm-fiber.toml"
    config = load_site_config({"SLURM_FIBER_CONFIG": str(example)})
    assert config.issuer == "mycluster" and config.fatal == set() and config.step_seconds == 2.0
    assert config.grant.limits.fibers == 16 and "mycluster" in config.trust


def test_the_slurm_homes_settings_come_from_the_site(tmp_path: Path) -> None:
    from slurm_fiber.homes.slurm.siteconfig import home_config

    gres = tmp_path / "gres.conf"
    gres.write_text("AutoDetect=off\nNodeName=n[1-2] Name=gpu File=/dev/nvidia[0-1]\n")
    text = f'state_root = "/srv/sf"\ngres_conf = "{gres}"\npublish_comment = true\n'
    settings = home_config(load_site_config(write(tmp_path, text)), "n2", poll_every=2.0)
    assert settings.state_root == Path("/srv/sf") and settings.publish_comment
    assert dict(settings.gpu_files) == {0: "/dev/nvidia0", 1: "/dev/nvidia1"}
    assert settings.poll_every == 2.0
    assert dict(home_config(load_site_config(write(tmp_path, "")), "n1").gpu_files) == {}
    env = write(tmp_path, text)
    gres.write_text("NodeName=n[1- Name=gpu File=/dev/x\n")
    with pytest.raises(SiteConfigError, match="gres_conf"):
        home_config(load_site_config(env), "n1")
    gres.unlink()
    with pytest.raises(SiteConfigError, match="No such file"):
        home_config(load_site_config(env), "n1")


def test_the_module_docstring_example_loads(tmp_path: Path) -> None:
    from slurm_fiber.homes.slurm import siteconfig

    doc = siteconfig.__doc__ or ""
    example = doc.split("Example::")[1].split("The prolog checks")[0]
    text = "\n".join(line[4:] for line in example.splitlines())
    config = load_site_config(write(tmp_path, text))
    assert config.issuer == "citest" and config.grant.limits.fibers == 8
