"""Files that a reader never sees half-written.

Note [Whole files]
~~~~~~~~~~~~~~~~~~
What we write for people and for other processes (the timeline, profiles,
benchmark records) is read while jobs run: a script reads its timeline
after ``step()``, a test reads another rank's file. A file rewritten in
place can be read mid-write: a complete JSON followed by the rest of an
older one, or a cut-off body. So every such file reaches its path by a
rename: the content is written to a temporary file in the same folder
(same file system, so the rename is atomic) and ``os.replace``d over the
path, and a reader opens either the old file or the new one, whole.

A file that grows (the timeline, appended to after every iteration) keeps
its appends in a hidden working file beside it, and each ``flush()``
publishes a copy of that by the same rename; the copy is made by the kernel
(``shutil.copyfile``), so publishing costs the file's size in a copy, not
in Python. A process killed between two flushes leaves the last published
file whole, and its working file (``.<name>.<pid>.part``) behind.

Temporary files are created with the mode a plain ``open(path, "w")`` would
give (0o666 less the umask), not ``mkstemp``'s 0o600.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import threading

_counter = itertools.count()


def _replace_with(path: str, fill) -> None:
    """``fill(tmp)`` writes a new, hidden, empty file beside ``path``, which is then renamed over ``path``; on
    any failure the temporary file goes and ``path`` is as it was."""
    folder, base = os.path.split(os.path.abspath(path))
    while True:
        tmp = os.path.join(folder, f".{base}.{os.getpid()}.{threading.get_ident()}.{next(_counter)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            break
        except FileExistsError:
            continue
    try:
        fill(tmp)  # into the existing file: its mode stays the one made here
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_whole(path: str | os.PathLike, data: bytes | str) -> None:
    """Write ``data`` (text as UTF-8) to ``path``, replacing what was there at once (Note [Whole files])."""
    payload = data.encode() if isinstance(data, str) else data

    def fill(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(payload)

    _replace_with(os.fspath(path), fill)


class AppendedWhole:
    """A binary file written with ``write``/``seek``/``tell`` and published whole at each ``flush()``
    (Note [Whole files]). ``name`` is the published path. Opening fails, as ``open(path, "wb")`` would, where
    the folder cannot be written; the path then holds an empty file until the first flush."""

    def __init__(self, path: str | os.PathLike):
        self.name = os.fspath(path)
        folder, base = os.path.split(os.path.abspath(self.name))
        self._work_path = os.path.join(folder, f".{base}.{os.getpid()}.part")
        self._work = open(self._work_path, "w+b")  # noqa: SIM115 - closed by close()
        self._unpublished = True  # written since the last flush (at first: the empty file)
        try:
            self.flush()
        except BaseException:
            self._discard()
            raise

    def write(self, data: bytes) -> int:
        self._unpublished = True
        return self._work.write(data)

    def seek(self, offset: int) -> int:
        return self._work.seek(offset)

    def tell(self) -> int:
        return self._work.tell()

    def flush(self) -> None:
        """Publish what was written since the last flush, if anything: a copy of the working file renamed over
        ``name``. With nothing new it copies nothing, and a published file that someone removed stays removed."""
        if not self._unpublished:
            return
        self._work.flush()
        _replace_with(self.name, lambda tmp: shutil.copyfile(self._work_path, tmp))
        self._unpublished = False

    def close(self) -> None:
        """Publish what is not yet published and remove the working file; idempotent."""
        if self._work.closed:
            return
        try:
            self.flush()
        finally:
            self._discard()

    def _discard(self) -> None:
        self._work.close()
        with contextlib.suppress(OSError):
            os.unlink(self._work_path)
