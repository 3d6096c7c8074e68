"""Dir: the lease directory, one sub-directory per held resource.

A claim is ``mkdir <dir>/<resource>`` (atomic: exactly one claimer wins)
followed by writing ``holder.json`` inside it through a temporary file and a
rename, so a reader sees the whole record or none. A reader that finds the
directory without a record yet (a claim in its first milliseconds, or a
claimer that crashed between the two steps) treats the resource as held by
an unknown holder, ``holder="?"`` and purpose ``(being claimed)``; only a
deliberate release frees such a lease. A release renames the directory
away (atomic) and then deletes it. Names starting with ``.`` are never
leases, so temporary files and released directories are skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from slurm_fiber.lease.errors import LeaseError, io_failure
from slurm_fiber.lease.files import read_json, write_atomic
from slurm_fiber.lease.holder import Holder
from slurm_fiber.lease.names import check_resource

HOLDER_FILE = "holder.json"
MAX_RECORD_BYTES = 64 * 1024
BEING_CLAIMED = "(being claimed)"


def _placeholder(resource: str, purpose: str) -> Holder:
    return Holder(env=resource, holder="?", session="", purpose=purpose, since="")


class Dir:
    """The lease directory at ``path``; created on the first claim.

    Every method may be called from any process at any time; none blocks
    except on disk I/O. Bad resource names and I/O failures raise LeaseError
    with one line; nothing valid is overwritten on any error.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def claim(self, resource: str, holder: Holder) -> Holder | None:
        """Take ``resource`` for ``holder``; None when taken, else the current holder.

        ``holder.env`` must equal ``resource``. When the resource is held
        already nothing is written and the current holder is returned (a
        placeholder while its record is being written).
        """
        check_resource(resource)
        if holder.env != resource:
            raise LeaseError(f"holder record names {holder.env!r}, not the claimed {resource!r}")
        data = json.dumps(holder.to_json(), sort_keys=True).encode() + b"\n"
        lease = self.path / resource
        for _ in range(100):
            try:
                self.path.mkdir(parents=True, exist_ok=True)
                lease.mkdir(mode=0o755)
            except FileExistsError:
                current = self.get(resource)
                if current is not None:
                    return current
                continue  # released between our mkdir and our read: try again
            except OSError as err:
                raise io_failure(f"claim {resource} in {self.path}", err) from None
            try:
                write_atomic(lease / HOLDER_FILE, data)
            except LeaseError:
                with contextlib.suppress(OSError):
                    lease.rmdir()
                raise
            return None
        raise LeaseError(f"{resource} in {self.path} keeps changing hands; try again")

    def get(self, resource: str) -> Holder | None:
        """The holder of ``resource``, or None when it is free.

        Raises LeaseError when the record exists but cannot be read (corrupt,
        truncated, unknown fields): the resource stays held until released.
        """
        check_resource(resource)
        lease = self.path / resource
        record = lease / HOLDER_FILE
        try:
            obj = read_json(record, MAX_RECORD_BYTES, "holder record")
        except FileNotFoundError:
            return _placeholder(resource, BEING_CLAIMED) if lease.is_dir() else None
        except NotADirectoryError:
            raise LeaseError(f"{lease} is a file, not a lease directory; move it aside") from None
        try:
            found = Holder.from_json(obj, f"holder record {record}")
        except ValueError as err:
            raise LeaseError(f"{err}; `lease release {resource}` frees it deliberately") from None
        if found.env != resource:
            raise LeaseError(f"holder record {record} names {found.env!r}, not {resource!r}")
        return found

    def list(self) -> list[Holder]:
        """Every held lease, oldest first (by ``since``, then name).

        A lease whose record cannot be read is listed with ``holder="?"`` and
        the reason as its purpose, so one bad record never hides the others.
        """
        try:
            entries = [e.name for e in os.scandir(self.path) if e.is_dir()]
        except FileNotFoundError:
            return []
        except OSError as err:
            raise io_failure(f"list {self.path}", err) from None
        found: list[Holder] = []
        for name in entries:
            if name.startswith("."):
                continue
            try:
                holder = self.get(name)
            except LeaseError as err:
                holder = _placeholder(name, f"(unreadable record: {err})")
            if holder is not None:
                found.append(holder)
        return sorted(found, key=lambda h: (h.since_time(), h.env))

    def release(self, resource: str) -> None:
        """Free ``resource``; a no-op when it is free. Raises LeaseError when it cannot."""
        check_resource(resource)
        gone = self.path / f".released.{resource}.{os.urandom(6).hex()}"
        try:
            os.rename(self.path / resource, gone)
        except FileNotFoundError:
            return
        except OSError as err:
            raise io_failure(f"release {resource} in {self.path}", err) from None
        shutil.rmtree(gone, ignore_errors=True)
