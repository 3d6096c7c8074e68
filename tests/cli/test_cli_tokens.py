"""The real console script: keys gen, token mint/verify/inspect, exit codes, no tracebacks."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(sys.executable).with_name("slurm-fiber")


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(SCRIPT), *args], input=stdin, capture_output=True, text=True,
                          timeout=60)
    assert "Traceback" not in proc.stderr + proc.stdout
    return proc


@pytest.fixture(scope="module")
def issued(tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("keys") / "issuer"
    gen = run("keys", "gen", "--issuer", "site", "--out", str(out), "--alg", "ES256", "--json")
    assert gen.returncode == 0, gen.stderr
    info = json.loads(gen.stdout)
    token = run("token", "mint", "--key", info["key"], "--issuer", "site", "--sub", "grant-7",
                "--aud", "job-1", "--ttl", "15m", "--fibers", "3", "--memory", "512M",
                "--preload", "json,email", "--warm", "json:dumps", "--seconds", "60",
                "--env", "OMP_NUM_THREADS=1", "--device", "gpu")
    assert token.returncode == 0, token.stderr
    return {**info, "token": token.stdout.strip(), "dir": str(out)}


def test_keys_gen_writes_a_private_key_0600_and_a_jwks_with_its_kid(issued):
    key = Path(issued["key"])
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and b"PRIVATE KEY" in key.read_bytes()
    assert stat.S_IMODE(Path(issued["dir"]).stat().st_mode) == 0o755  # the JWKS is for all
    jwks = json.loads(Path(issued["jwks"]).read_text())
    assert [k["kid"] for k in jwks["keys"]] == [issued["kid"]]
    assert jwks["keys"][0]["alg"] == "ES256" and "d" not in jwks["keys"][0]


def test_verify_a_minted_token(issued):
    proc = run("token", "verify", "--trust", f"site={issued['jwks']}", "--aud", "job-1",
               issued["token"])
    assert proc.returncode == 0
    out = json.loads(proc.stdout)
    assert out["ok"] is True and out["grant"]["uid"] == "grant-7"
    assert out["grant"]["fiber"] == {
        "template": {"preload": ["json", "email"], "warm": "json:dumps",
                     "env": {"OMP_NUM_THREADS": "1"}},
        "limits": {"fibers": 3, "memory": 512 * 1024**2, "seconds": 60.0},
        "devices": ["gpu"],
    }


@pytest.mark.parametrize(("token", "reason"), [
    ("a.b.c.d", "malformed"), ("x" * 70_000, "oversize"),
])
def test_verify_refusals_are_one_json_object_and_exit_1(issued, token, reason):
    proc = run("token", "verify", "--trust", f"site={issued['jwks']}", "--aud", "job-1", "-",
               stdin=token)
    assert proc.returncode == 1
    out = json.loads(proc.stdout)
    assert out == {"ok": False, "code": "invalid_token", "reason": reason,
                   "detail": out["detail"]}
    assert len(proc.stdout.strip().splitlines()) == 1


def test_verify_wrong_audience_from_stdin(issued):
    proc = run("token", "verify", "--trust", f"site={issued['jwks']}", "--aud", "job-2",
               stdin=issued["token"] + "\n")
    assert proc.returncode == 1 and json.loads(proc.stdout)["reason"] == "wrong_audience"


@pytest.mark.parametrize("args", [
    ("token", "verify", "--trust", "no-equals", "--aud", "a", "t"),
    ("token", "verify", "--trust", "site=/nonexistent.json", "--aud", "a", "t"),
    ("token", "mint", "--key", "/nonexistent", "--issuer", "s", "--sub", "bad uid!", "--aud",
     "a"),
    ("token", "mint", "--key", "/nonexistent", "--issuer", "s", "--sub", "u", "--aud", "a",
     "--ttl", "forever"),
    ("keys", "gen", "--issuer", "s", "--out", "/tmp/x", "--alg", "RS256"),
])
def test_usage_errors_exit_2_in_one_line(args):
    proc = run(*args)
    assert proc.returncode == 2, proc.stderr


def test_mint_with_an_unreadable_key_fails_with_exit_1(tmp_path):
    junk = tmp_path / "junk.key"
    junk.write_text("not a key")
    proc = run("token", "mint", "--key", str(junk), "--issuer", "s", "--sub", "u", "--aud", "a")
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1


def test_inspect_decodes_without_trust_and_refuses_garbage(issued):
    proc = run("token", "inspect", issued["token"])
    assert proc.returncode == 0
    out = json.loads(proc.stdout)
    assert out["verified"] is False and out["claims"]["sub"] == "grant-7"
    assert out["header"]["kid"] == issued["kid"] and 0 < out["expires_in"] <= 900
    bad = run("token", "inspect", "-", stdin="\x00\xff not.a.token")
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1
