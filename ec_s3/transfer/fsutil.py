"""Safe local files for the data path: private directories and exclusive, no-follow files.

Directories are created ``0700`` and one someone else could write into is refused naming
its config key; files are created ``O_CREAT|O_EXCL|O_NOFOLLOW`` (``0600``) and opened
``O_NOFOLLOW``, so nobody can substitute a blob or plant a symlink. Owns those checks and
flags. Does not own what goes into the files (staging, spool) or any clean-up policy.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ec_s3.config import ConfigError

__all__ = ["UnsafeDirectory", "create_exclusive", "ensure_private_dir", "open_nofollow"]

# O_CLOEXEC: a file descriptor of ours must not leak into a process vLLM execs.
_CREATE_FLAGS = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeDirectory(ConfigError):
    """A configured directory could be written by someone other than this user.

    ``key`` names the config key, ``path`` the directory, ``problem`` what is wrong.
    """

    def __init__(self, key: str, path: str, problem: str, hint: str = "") -> None:
        super().__init__(
            f"{key}={path!r} {problem}; ec-s3 keeps blobs there that it later loads or uploads, so "
            f"anyone who can write into it could substitute them. Point {key} at a directory owned by "
            f"this user (uid {os.geteuid()}) with mode 0700 (e.g. `install -d -m 0700 {path}`){hint}."
        )
        self.key, self.path, self.problem = key, path, problem


def ensure_private_dir(path: str | os.PathLike[str], *, key: str, shared_ok: bool = False) -> Path:
    """Create ``path`` (mode 0700, parents as needed) or check the existing one.

    Refused: not a directory, owned by another user than this one (root excepted),
    or writable by group/others. ``shared_ok`` accepts a world-writable directory
    with the sticky bit owned by root or us (``/dev/shm``, ``/tmp``): nobody else
    can then remove or rename what we create in it, and callers put their files in a
    private subdirectory of their own.
    """
    p = Path(path)
    try:
        p.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(p)
    except OSError as exc:
        raise UnsafeDirectory(key, str(p), f"cannot be created or read ({exc.strerror})") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(key, str(p), "is not a directory")
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise UnsafeDirectory(key, str(p), f"is owned by uid {st.st_uid}, not by this user")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        sticky = bool(st.st_mode & stat.S_ISVTX)
        if not (shared_ok and sticky):
            # A Kubernetes emptyDir is 0777 without the sticky bit: a subdirectory we
            # create ourselves (0700) is the easy way out.
            hint = f", or at a subdirectory such as {p / 'ec-s3'} that ec-s3 creates with mode 0700" if shared_ok else ""
            raise UnsafeDirectory(
                key, str(p), f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})", hint,
            )
    elif st.st_uid != me and not shared_ok:
        # Root's private directory: we could not write there anyway, say so now.
        raise UnsafeDirectory(key, str(p), "is owned by root, not by this user")
    return p


def create_exclusive(path: str | os.PathLike[str], flags: int = os.O_RDWR) -> int:
    """Create a new file (mode 0600); fails if anything, a symlink included, is there."""
    return os.open(path, flags | _CREATE_FLAGS, 0o600)


def open_nofollow(path: str | os.PathLike[str], flags: int = os.O_RDONLY) -> int:
    """Open an existing file without following a symlink at its last component."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
