"""``slurm-fiber keys`` and ``slurm-fiber token``: issuer keys and grant tokens without Python.

``keys gen`` makes an issuer key (0600 PEM) and adds its public half to the
issuer's JWKS (written atomically, earlier keys kept, so rotation is: gen a
new key, start minting with it, drop the old key from the JWKS later).
``token mint`` signs a grant; ``token verify`` checks one exactly as fiberd
does and prints one JSON object; ``token inspect`` decodes one without
trusting it. Exit codes: 0 success / valid, 1 refused or failed (one line
says why), 2 usage error. No traceback reaches the user.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, NoReturn, cast

import typer

from slurm_fiber.core.clock import SystemClock
from slurm_fiber.core.fibers.spec import fiber_spec_to_json, number_in_range, parse_fiber_spec
from slurm_fiber.core.trust.grant import VerifiedToken, valid_uid
from slurm_fiber.core.trust.issuers import TrustStore, public_jwk
from slurm_fiber.core.trust.mint import ALGS, generate_key, load_private_key, mint, save_private_key
from slurm_fiber.core.trust.tokens import (
    MAX_TOKEN_BYTES,
    MAX_UNIX_TIME,
    TokenRefused,
    TokenVerifier,
    decode_unverified,
)
from slurm_fiber.safefs import UnsafePath, open_dir, replace_file

EXIT_CODES = "Exit codes: 0 success / valid; 1 refused or failed (one line says why); 2 usage."
keys_app = typer.Typer(help=f"Issuer signing keys and their JWKS.\n\n{EXIT_CODES}",
                       no_args_is_help=True)
token_app = typer.Typer(help=f"Grant tokens: mint, verify, inspect.\n\n{EXIT_CODES}",
                        no_args_is_help=True)

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd]?)")
_SIZE = re.compile(r"(\d+)\s*([KMGT]?)(?:i?B)?", re.IGNORECASE)
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
TOKEN_ARG = typer.Argument("-", help="The token, or - to read it from stdin.")


def _fail(message: str, code: int = 1) -> NoReturn:
    typer.echo(f"slurm-fiber: {message}", err=True)
    raise typer.Exit(code)


def parse_duration(text: str) -> float:
    """Seconds in '90', '90s', '15m', '1h', '2d'. ValueError otherwise."""
    m = _DURATION.fullmatch(text.strip())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a positive duration (e.g. 90s, 15m, 1h, 2d)")
    return float(m.group(1)) * _SECONDS[m.group(2)]


def parse_size(text: str) -> int:
    """Bytes in '1073741824', '512M', '1G', '1GiB' (powers of 1024). ValueError otherwise."""
    m = _SIZE.fullmatch(text.strip())
    if not m or int(m.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a positive size in bytes (e.g. 512M, 4G)")
    power = "KMGT".find(m.group(2).upper()) + 1 if m.group(2) else 0
    return int(m.group(1)) * 1024**power


def _read_token(token: str) -> bytes:
    if token != "-":
        return token.encode("utf-8", "surrogateescape")
    return sys.stdin.buffer.read(MAX_TOKEN_BYTES + 1)


@keys_app.command("gen")
def keys_gen(
    issuer: str = typer.Option(..., help="Issuer name; tokens carry it as 'iss'."),
    out: Path = typer.Option(..., help="Directory for the key and the JWKS (created 0755: "
                                       "every job's fiberd reads the JWKS; the key is 0600)."),
    alg: str = typer.Option("EdDSA", help="EdDSA (Ed25519) or ES256 (P-256)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Create a signing key (OUT/ISSUER-KID.key, mode 0600) and add it to OUT/ISSUER.jwks.json.

    OUT is made 0755 (its missing parents too): the JWKS in it (0644) is what every
    job's fiberd, running as the job user, must read; the private key's own 0600
    keeps it root's. An OUT whose path anyone but this user or root could change
    (an owner or a parent writable by others) is refused: they could swap the key.

    An existing JWKS keeps its keys, so running this again rotates: mint with
    the new key file, and remove the old key from the JWKS once its tokens
    have expired. fiberd picks the JWKS change up without a restart.
    """
    if alg not in ALGS:
        _fail(f"--alg must be one of {', '.join(ALGS)}, not {alg!r}", 2)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", issuer):
        _fail(f"--issuer {issuer!r} must be a plain name ([A-Za-z0-9._-], up to 64)", 2)
    try:
        os.close(open_dir(os.path.abspath(out), trusted_owners=(os.geteuid(),),
                          create_mode=0o755))
    except UnsafePath as err:
        _fail(f"keys gen: --out {out} is not safe for a signing key: {err}")
    except (FileExistsError, NotADirectoryError):
        _fail(f"keys gen: --out {out} is not a directory (a file is in the way); give "
              "--out a directory")
    except OSError as err:
        _fail(f"keys gen: cannot make --out {out}: {err.strerror or err}")
    try:
        key = generate_key(alg)
        jwk = public_jwk(key)
        key_path = out / f"{issuer}-{jwk['kid'][:12]}.key"
        jwks_path = out / f"{issuer}.jwks.json"
        keys = json.loads(jwks_path.read_text())["keys"] if jwks_path.exists() else []
        save_private_key(key, key_path)
        replace_file(jwks_path, json.dumps({"keys": [*keys, jwk]}, indent=2).encode(), mode=0o644)
    except OSError as err:
        where = f" {err.filename}" if err.filename else ""
        _fail(f"keys gen failed:{where}: {err.strerror or err}")
    except (ValueError, KeyError, TypeError) as err:
        _fail(f"keys gen failed: {jwks_path} is not a JWKS ({err}); move it aside or give "
              "another --out")
    result = {"issuer": issuer, "alg": alg, "kid": jwk["kid"], "key": str(key_path),
              "jwks": str(jwks_path)}
    typer.echo(json.dumps(result) if as_json else
               f"key {key_path} (kid {jwk['kid']}, {alg}); public key added to {jwks_path}")


@token_app.command("mint")
def token_mint(
    key: Path = typer.Option(..., help="Issuer private key (PEM) from 'keys gen'."),
    issuer: str = typer.Option(..., help="Issuer name (must match the trust configuration)."),
    sub: str = typer.Option(..., help="Grant UID ([A-Za-z0-9][A-Za-z0-9._:@-]{0,127})."),
    aud: list[str] = typer.Option(..., help="Audience fiberd checks (repeat for several)."),
    ttl: str = typer.Option("1h", help="Lifetime: 90s, 15m, 1h, 2d."),
    preload: str = typer.Option("", help="Modules the template imports, comma-separated."),
    warm: str | None = typer.Option(None, help="Warm-up hook, 'module:function'."),
    env: list[str] = typer.Option([], help="Template env NAME=VALUE (repeatable)."),
    fibers: int | None = typer.Option(None, help="Max concurrent fibers."),
    memory: str | None = typer.Option(None, help="Memory limit per grant (bytes, or 512M, 4G)."),
    pids: int | None = typer.Option(None, help="Max processes per grant."),
    cpu: float | None = typer.Option(None, help="CPUs per grant (e.g. 1.5)."),
    seconds: float | None = typer.Option(None, help="Per-fiber wall-time limit in seconds."),
    device: list[str] = typer.Option([], help="Device kind the grant may drive (repeatable)."),
) -> None:
    """Sign a grant token and print it (compact JWS) on stdout."""
    try:
        fiber: dict[str, Any] = {
            "template": {
                "preload": [m for m in preload.split(",") if m],
                **({"warm": warm} if warm else {}),
                "env": dict(_env_pair(e) for e in env),
            },
            "limits": {name: value for name, value in (
                ("fibers", fibers), ("memory", parse_size(memory) if memory else None),
                ("pids", pids), ("cpu", cpu), ("seconds", seconds)) if value is not None},
            "devices": device,
        }
        spec = parse_fiber_spec(fiber)
        lifetime = parse_duration(ttl)
        if not valid_uid(sub):
            raise ValueError(f"--sub {sub!r} is not a grant UID ([A-Za-z0-9][A-Za-z0-9._:@-]*)")
    except ValueError as err:
        _fail(str(err), 2)
    try:
        private = load_private_key(key)
    except (OSError, ValueError) as err:
        _fail(f"cannot use --key: {getattr(err, 'strerror', None) or err}")
    now = time.time()
    try:
        token = mint(private, issuer=issuer, uid=sub, audience=aud[0] if len(aud) == 1 else aud,
                     iat=now, exp=now + lifetime, spec=spec)
    except ValueError as err:
        _fail(str(err), 2)
    typer.echo(token)


def _env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep:
        raise ValueError(f"--env {text!r} must be NAME=VALUE")
    return name, value


def _grant_json(vt: VerifiedToken) -> dict[str, Any]:
    return {"uid": vt.uid, "issuer": vt.issuer, "jti": vt.jti, "audience": list(vt.audience),
            "exp": vt.exp, "iat": vt.iat, "nbf": vt.nbf, "leeway_used": vt.leeway_used,
            "fiber": fiber_spec_to_json(vt.spec)}


@token_app.command("verify")
def token_verify(
    token: str = TOKEN_ARG,
    trust: list[str] = typer.Option(..., help="Trusted issuer as NAME=JWKS_FILE (repeatable)."),
    aud: str = typer.Option(..., help="This fiberd's audience."),
    leeway: float = typer.Option(30.0, help="Clock-skew leeway for nbf/iat, seconds."),
) -> None:
    """Verify a token as fiberd would; print one JSON object.

    {"ok": true, "grant": {...}} and exit 0, or {"ok": false, "code":
    "invalid_token", "reason": CODE, "detail": ...} and exit 1.
    """
    issuers: dict[str, str] = {}
    for item in trust:
        name, sep, path = item.partition("=")
        if not (sep and name and path):
            _fail(f"--trust {item!r} must be NAME=JWKS_FILE", 2)
        issuers[name] = path
    if leeway < 0:
        _fail("--leeway must not be negative", 2)
    store = TrustStore(issuers)
    for name, problem in store.problems().items():
        if not store.keys(name):
            _fail(problem, 2)
        typer.echo(f"slurm-fiber: warning: {problem}", err=True)
    try:
        vt = TokenVerifier(store, aud, SystemClock(), leeway).verify(_read_token(token))
    except TokenRefused as err:
        typer.echo(json.dumps({"ok": False, "code": "invalid_token", "reason": err.reason.value,
                               "detail": err.detail}))
        raise typer.Exit(1) from None
    typer.echo(json.dumps({"ok": True, "grant": _grant_json(vt)}))


@token_app.command("inspect")
def token_inspect(token: str = TOKEN_ARG) -> None:
    """Decode a token WITHOUT verifying it (for people); exit 1 if it cannot be decoded."""
    try:
        decoded = decode_unverified(_read_token(token))
    except TokenRefused as err:
        _fail(f"cannot decode token ({err.reason}): {err.detail}")
    out: dict[str, Any] = {"verified": False, "header": decoded.header,
                           "claims": decoded.claims, "signature_bytes": len(decoded.signature)}
    for name in ("iat", "nbf", "exp"):
        value = decoded.claims.get(name)
        if number_in_range(value, 0, MAX_UNIX_TIME, integer=False):  # never a huge int as float
            out[f"{name}_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(value))
            if name == "exp":
                out["expires_in"] = round(cast(float, value) - time.time(), 1)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[f"{name}_utc"] = "out of range"
    typer.echo(json.dumps(out, indent=2, default=str))
