"""Which ``sys.path`` entries a template may import from.

``safe_path_entry(entry)`` answers for one entry: an absolute, existing
directory that ``slurm_fiber.safefs.open_dir`` trusts (every component from
"/" owned by root or fiberd's uid and writable by nobody else, a sticky
ancestor such as /tmp allowed), or a zip file in such a directory that only
a trusted owner may write. Anything else (the current directory, a relative
entry, another user's directory) is refused with one line saying why, so no
directory another user can write is ever imported from by a template or its
fibers. The walk itself is safefs's; this module only applies it to entries.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Collection

from slurm_fiber.safefs import UnsafePath, open_dir


def trusted_owners(owners: Collection[int] | None = None) -> tuple[int, ...]:
    """Root and ``owners`` (default: this process's euid), as ``open_dir`` takes them."""
    return (0, *({os.geteuid()} if owners is None else set(owners)))


def safe_path_entry(entry: str, owners: Collection[int] | None = None) -> str | None:
    """Why ``entry`` (a sys.path entry) must not be imported from, or None when it is safe.

    Relative entries ("" is the current directory) and missing paths are
    unsafe. Blocks only on the file system; never raises.
    """
    if not entry or not os.path.isabs(entry):
        return f"{entry or '(the current directory)'} is relative to the current directory"
    directory = entry
    if not os.path.isdir(entry):
        if not os.path.exists(entry):
            return f"{entry} does not exist"
        directory = os.path.dirname(entry)
    trusted = trusted_owners(owners)
    try:
        os.close(open_dir(directory, trusted_owners=trusted))
        if directory != entry:
            st = os.lstat(entry)
            if not stat.S_ISREG(st.st_mode) or st.st_uid not in trusted or st.st_mode & 0o022:
                return f"{entry} is not a regular file only a trusted owner may write"
    except OSError as err:
        return str(err) if isinstance(err, UnsafePath) else f"{entry}: {err.strerror or err}"
    return None
