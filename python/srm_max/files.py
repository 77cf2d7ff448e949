"""Atomic writes: a file or a directory appears complete or not at all; and the rules every
path a user names is held to (not empty, and a regular file where a file is read).

Every write that a reader might see half-done (a checkpoint, a compiled graph in
the cache, a results file) goes through this module:

- ``atomic_file(path)`` yields a temporary path beside ``path``; whatever the
  body writes there replaces ``path`` in one ``os.replace`` when the body
  succeeds, and is removed when it fails. ``atomic_write_bytes`` and
  ``atomic_write_text`` are the one-call forms; ``torch.save`` and other
  writers that take a path use ``atomic_file`` directly.
- ``atomic_directory(path, force)`` does the same for a whole directory (a
  model checkpoint), exchanging it with an existing one in one atomic step
  where the system can.

The temporary names are hidden (``.name.tmp-*``) and unique per writer, so
concurrent writers of the same path never write into one temporary file, and
what a kill leaves behind is never mistaken for the real thing. Atomic here
means against a killed or failing process: nothing is fsynced, so a power loss
may still lose the newest write.

``check_regular_file(path, error)`` is the one check every reader of a file a user
names (a config, weights, tokenizer, certificate, text) makes before opening it:
opening a named pipe blocks until something writes to it, and a directory or a
device is no file to read either. ``check_no_empty_paths(args, arguments, error)``
refuses an empty path argument of a command line.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from .errors import CheckpointError, SRMError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def check_regular_file(path: str | Path, error: type[SRMError] = CheckpointError, name: str | None = None) -> None:
    """Raise ``error`` when ``path`` exists (symbolic links followed) but is no regular file: a
    directory, a named pipe, a device, a socket. Checked with ``os.stat``, never by opening it,
    since opening a named pipe blocks until a writer comes. A path that cannot be looked up
    (missing, no permission) passes: the reader's own open reports that in its words. ``name``:
    how the message shows the path (``--text notes.txt``); default the path itself."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # ValueError: a path with a NUL byte, which open refuses too
        return
    if not stat.S_ISREG(mode):
        kind = next((kind for test, kind in _KINDS if test(mode)), "a special file")
        raise error(f"{path if name is None else name}: is {kind}, not a regular file")


def check_no_empty_paths(args: object, arguments: Mapping[str, str], error: type[SRMError]) -> None:
    """``error`` naming the first of ``arguments`` (attribute of ``args`` -> how the usage shows
    it) that is an empty string. ``Path("")`` is the current directory, and an empty option
    would otherwise be taken as not given (``--config ""`` as "infer the config"), so an empty
    path never means what was typed."""
    for name, shown in arguments.items():
        if getattr(args, name, None) == "":
            raise error(f"{shown}: an empty path names no file or directory")


def _temporary_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary path beside ``path``; on success it replaces ``path``.

    The body creates the file (``open(tmp, "wb")``, ``torch.save(obj, tmp)``...),
    so it gets the permissions any new file gets. On an error the temporary file
    is removed and ``path`` keeps its old content (or stays absent).
    """
    path = Path(path)
    tmp = _temporary_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see ``atomic_file``)."""
    with atomic_file(path) as tmp, open(tmp, "xb") as f:
        f.write(data)


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> None:
    """Write ``text`` to ``path`` atomically (see ``atomic_file``)."""
    atomic_write_bytes(path, text.encode(encoding))


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def exchange_paths(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``);
    False where the C library, kernel or file system does not offer it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _swap_into_place(tmp: Path, destination: Path) -> None:
    """Make the complete ``tmp`` the ``destination``.

    A new destination is one rename. An existing one is exchanged with ``tmp`` in one
    atomic step, so at every instant ``destination`` is the complete old or the complete
    new directory; ``tmp`` then holds the old one (a directory, or a symbolic link that
    pointed at one), which ``atomic_directory`` removes. Where no atomic
    exchange exists (not Linux, or a file system without it) the old directory is first
    renamed aside: a kill between the two renames leaves ``destination`` missing and the
    old model in a hidden ``.name.old-*/old`` folder beside it.
    """
    if not os.path.lexists(destination):
        os.replace(tmp, destination)
    elif not exchange_paths(tmp, destination):
        backup = Path(tempfile.mkdtemp(prefix=f".{destination.name}.old-", dir=destination.parent))
        os.replace(destination, backup / "old")
        os.replace(tmp, destination)
        shutil.rmtree(backup, ignore_errors=True)


@contextmanager
def atomic_directory(destination: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside ``destination``; on success it replaces it.

    Nothing is overwritten without ``force`` (``CheckpointError``: the directories
    written this way are models); on any error (or a kill) the old destination
    stays whole and the temporary directory is removed (or, after a kill, left as
    a hidden ``.name.tmp-*`` that is never mistaken for a model). The replacement
    itself is atomic where the system can exchange two directories
    (``_swap_into_place``).
    """
    destination = Path(destination)
    check_replaceable(destination, force)
    destination.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{destination.name}.tmp-", dir=destination.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; a model directory is not
    try:
        yield tmp
        _swap_into_place(tmp, destination)
    finally:
        _remove(tmp)


def check_replaceable(destination: Path, force: bool) -> None:
    """``CheckpointError`` unless ``atomic_directory`` may write ``destination``: it is new, or
    a directory and ``force`` is given. Anything else in its place (a file, a link to
    nothing) is never replaced, even with ``force``: a model is a directory, so a file there
    is most likely a path typed wrong, and not ours to delete."""
    if not os.path.lexists(destination):
        return
    if not destination.is_dir():
        raise CheckpointError(f"{destination}: exists and is not a directory; a checkpoint is a directory, so it "
                              "is not replaced (even with --force): remove it or choose another path")
    if not force:
        raise CheckpointError(f"{destination}: already exists (use --force to overwrite)")


def _remove(path: Path) -> None:
    """Remove ``path``, a directory, file or symbolic link (never what a link points at).
    Best effort: what is left is hidden, and never mistaken for a model."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


__all__ = ["atomic_file", "atomic_write_bytes", "atomic_write_text", "atomic_directory", "check_no_empty_paths",
           "check_regular_file", "check_replaceable", "exchange_paths"]
