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

Every entry is reached through a descriptor of the lease directory and
opened without following a link or blocking on a FIFO (lease.files). In an
*owned* area (``owners``, e.g. a Slurm node's root-only dir) an entry or a
record of any other owner is untrusted: never a lease, never followed; in a
cooperative one (``owners`` None) records may be anyone's, as with the
shell lock.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from slurm_fiber.lease.errors import LeaseError, io_failure
from slurm_fiber.lease.files import Owners, open_area, read_json, write_atomic
from slurm_fiber.lease.holder import Holder
from slurm_fiber.lease.names import check_resource

HOLDER_FILE = "holder.json"
MAX_RECORD_BYTES = 64 * 1024
BEING_CLAIMED = "(being claimed)"


def _placeholder(resource: str, purpose: str) -> Holder:
    return Holder(env=resource, holder="?", session="", purpose=purpose, since="")


def _still(area: int, name: str, fd: int) -> bool:
    """Whether ``name`` in ``area`` is still the directory open as ``fd`` (not released)."""
    try:
        st = os.stat(name, dir_fd=area, follow_symlinks=False)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino)


class Dir:
    """The lease directory at ``path``; created on the first claim when cooperative.

    ``owners`` (None: cooperative) are the uids whose entries are trusted,
    root's always. Every method may be called from any process at any time;
    none blocks except on disk I/O. Bad resource names, untrusted entries
    and I/O failures raise LeaseError with one line; nothing valid is
    overwritten on any error.
    """

    def __init__(self, path: str | os.PathLike[str], owners: Owners = None) -> None:
        self.path = Path(path)
        self.owners: Owners = None if owners is None else (0, *owners)

    @contextlib.contextmanager
    def _area(self, create: bool = False) -> Iterator[int | None]:
        """The lease dir's fd, or None when it does not exist (and ``create`` is off)."""
        try:
            fd = open_area(self.path, self.owners, create=create and self.owners is None)
        except FileNotFoundError:
            if create:
                raise LeaseError(f"the lease dir {self.path} does not exist") from None
            yield None
            return
        try:
            yield fd
        finally:
            os.close(fd)

    def _lease_fd(self, area: int, resource: str) -> int | None:
        """An fd of ``<resource>/`` in ``area``; None when absent. Raises LeaseError when it is
        a link, a file or (owned area) of an untrusted owner."""
        lease = self.path / resource
        try:
            fd = os.open(resource, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                         dir_fd=area)
        except FileNotFoundError:
            return None
        except OSError as err:
            if err.errno in (errno.ENOTDIR, errno.ELOOP):
                raise LeaseError(f"{lease} is not a lease directory (a file or a link); "
                                 "move it aside") from None
            raise io_failure(f"open {lease}", err) from None
        uid = os.fstat(fd).st_uid
        if self.owners is not None and uid not in self.owners:
            os.close(fd)
            raise LeaseError(f"{lease} belongs to uid {uid}, not to the lease area's owner: "
                             "untrusted, not a lease; move it aside")
        return fd

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
        with self._area(create=True) as area:
            assert area is not None
            for _ in range(100):
                try:
                    os.mkdir(resource, 0o755, dir_fd=area)
                except FileExistsError:
                    current = self._get(area, resource)
                    if current is not None:
                        return current
                    continue  # released between our mkdir and our read: try again
                except OSError as err:
                    raise io_failure(f"claim {resource} in {self.path}", err) from None
                lease_fd = self._lease_fd(area, resource)
                if lease_fd is None:
                    continue  # released (by force) right after our mkdir
                try:
                    os.fchmod(lease_fd, 0o755)  # whatever the umask
                    write_atomic(lease_fd, HOLDER_FILE, data, lease / HOLDER_FILE)
                except (LeaseError, OSError) as err:
                    with contextlib.suppress(OSError):
                        os.rmdir(resource, dir_fd=area)
                    if isinstance(err, LeaseError):
                        raise
                    raise io_failure(f"claim {resource} in {self.path}", err) from None
                finally:
                    os.close(lease_fd)
                return None
        raise LeaseError(f"{resource} in {self.path} keeps changing hands; try again")

    def get(self, resource: str) -> Holder | None:
        """The holder of ``resource``, or None when it is free.

        Raises LeaseError when the record exists but cannot be read (corrupt,
        truncated, unknown fields, a link or a FIFO, untrusted): the resource
        stays held until released.
        """
        check_resource(resource)
        with self._area() as area:
            return None if area is None else self._get(area, resource)

    def _get(self, area: int, resource: str) -> Holder | None:
        record = self.path / resource / HOLDER_FILE
        lease_fd = self._lease_fd(area, resource)
        if lease_fd is None:
            return None
        try:
            obj = read_json(lease_fd, HOLDER_FILE, MAX_RECORD_BYTES, "holder record", record,
                            self.owners)
        except FileNotFoundError:
            held = _still(area, resource, lease_fd)
            return _placeholder(resource, BEING_CLAIMED) if held else None
        finally:
            os.close(lease_fd)
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
        found: list[Holder] = []
        with self._area() as area:
            if area is None:
                return []
            try:
                entries = [e.name for e in os.scandir(area)
                           if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)]
            except OSError as err:
                raise io_failure(f"list {self.path}", err) from None
            for name in entries:
                try:
                    holder = self._get(area, name)
                except LeaseError as err:
                    holder = _placeholder(name, f"(unreadable record: {err})")
                if holder is not None:
                    found.append(holder)
        return sorted(found, key=lambda h: (h.since_time(), h.env))

    def release(self, resource: str) -> None:
        """Free ``resource``; a no-op when it is free. Raises LeaseError when it cannot."""
        check_resource(resource)
        gone = f".released.{resource}.{os.urandom(6).hex()}"
        with self._area() as area:
            if area is None:
                return
            try:
                st = os.stat(resource, dir_fd=area, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    raise LeaseError(f"{self.path / resource} is not a lease directory; "
                                     "move it aside")
                os.rename(resource, gone, src_dir_fd=area, dst_dir_fd=area)
            except FileNotFoundError:
                return
            except OSError as err:
                raise io_failure(f"release {resource} in {self.path}", err) from None
            shutil.rmtree(gone, dir_fd=area, ignore_errors=True)
