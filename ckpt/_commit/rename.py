"""The commit of local disk: a save is staged in a sibling directory ``<path>.tmp-<hex>`` and
committed by one rename (renameat2 NOREPLACE, or EXCHANGE when overwriting), so the checkpoint's
own layout has no generation prefix.

Saves in progress are protected by ``flock``: the saving process holds an exclusive lock on its
staged directory (and writes an owner record in it) until the rename; a manager holds one on its
directory while it saves. A staged directory is a dead leftover only once its lock is free and
its owner record says its process is gone. Bytes (the owner record, the manifest, every chunk)
go through the store; only the directory operations (mkdir, rename, flock, rmtree) are done here
on the store's directory (``store.root``, which stores with ``caps.renames`` have).
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
import time
import warnings
from typing import Callable, Iterable

from ckpt._commit.strategy import (
    OWN_TEMP,
    OWNER_LIMIT_BYTES,
    OWNER_NAME,
    UNOWNED_GRACE_S,
    DirLock,
    Leftover,
    SaveLock,
    boot_id,
    lock_holder,
    owner_bytes,
    owner_gone,
    owner_text,
    parse_owner,
)
from ckpt._commit.strategy import CommitStrategy, Staged, not_a_checkpoint, some
from ckpt._errors import CheckpointError, NotDurableError
from ckpt._format import MANIFEST_NAME, TEMP_MARK
from ckpt.storage import Storage, fsync_path


# ---- the directory renames a commit makes (renameat2) ---------------------------------

_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_libc = None


def _renameat2(src: str, dst: str, flags: int) -> bool:
    """renameat2(2) where the platform has it; False when it does not."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.renameat2  # noqa: B018  (probe)
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return False
    AT_FDCWD = -100
    rc = _libc.renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flags)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL):  # kernel or file system without the flag
        return False
    raise OSError(err, os.strerror(err), dst)


def rename_noreplace(src: str, dst: str) -> None:
    """Rename a directory into place; FileExistsError if `dst` exists, never replacing it."""
    if not _renameat2(src, dst, _RENAME_NOREPLACE):
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, "checkpoint already exists", dst)
        os.rename(src, dst)


def exchange(src: str, dst: str) -> bool:
    """Atomically swap two directories; False where the platform cannot."""
    return _renameat2(src, dst, _RENAME_EXCHANGE)


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)



def _what_is_there(path: str) -> str | None:
    """What is at `path` when it is not a jax-ckpt checkpoint (nor an empty directory, which
    holds nothing an overwrite could lose); None when it is one."""
    if os.path.islink(path):
        return f"a symbolic link to {os.readlink(path)!r}: save to the path it points to"
    if not os.path.isdir(path):
        return "a file" if os.path.isfile(path) else "not a directory"
    try:
        names = os.listdir(path)
    except OSError as e:
        return f"a directory that cannot be listed: {e.strerror}"
    if not names or MANIFEST_NAME in names:
        return None
    return f"a directory holding {some([n + '/' if os.path.isdir(os.path.join(path, n)) else n for n in names])}"


class RenameCommit(CommitStrategy):
    """A staged sibling directory, renamed into place."""

    for_renames = True

    @property
    def root(self) -> str:
        return self.store.root

    def _sibling(self, path: str) -> Storage:
        """The store of the directory `path` beside this one (wrapped as this store is)."""
        return self.store.parent().child(os.path.basename(path))

    def stage(self, *, overwrite: bool) -> Staged:
        root = self.root
        if os.path.lexists(root):
            what = _what_is_there(root)
            if what is not None:
                raise not_a_checkpoint(root, what)
            if not overwrite:
                raise FileExistsError(errno.EEXIST, "checkpoint already exists (pass overwrite=True to replace it)",
                                      root)
        os.makedirs(os.path.dirname(root), exist_ok=True)
        tmp = f"{root}{TEMP_MARK}{secrets.token_hex(6)}"
        os.mkdir(tmp)
        lock = None
        place = self._sibling(tmp)
        try:
            lock = DirLock.acquire(tmp)  # (a cleaner may be looking at it for a moment)
            place.put_if_absent(OWNER_NAME, owner_bytes())
        except BaseException:
            if lock is not None:
                lock.release()
            remove_tree(tmp)
            raise
        return Staged(place, "", {"tmp": os.path.basename(tmp)}, lock)

    def staged_from(self, info: dict) -> Staged:
        return Staged(self._sibling(info["tmp"]), "", info)

    def _commit(self, staged: Staged, manifest: bytes, *, overwrite: bool,
                old_data: Callable[[], Iterable[str]] | None) -> None:
        place = staged.storage
        place.delete(OWNER_NAME)  # the checkpoint holds only what the format describes
        place.put_if_absent(MANIFEST_NAME, manifest)
        place.sync("")
        displaced, hold = self._publish(place.root, overwrite=overwrite)
        # Committed: from here on the save has succeeded, whatever fails.
        try:
            self.store.parent().sync("")
        except OSError as e:
            if hold is not None:
                hold.release()
            raise NotDurableError(
                f"checkpoint {self.root} was committed (it is in place and readable), but it may not be durable: "
                f"syncing its directory entry failed: {e}"
                + (f"; the previous checkpoint is kept at {displaced}" if displaced is not None else "")
            ) from e
        if displaced is not None:
            try:
                self._sibling(displaced).delete_tree("")
            except OSError as e:
                warnings.warn(f"checkpoint {self.root} committed, but the previous one at {displaced} could not "
                              f"be deleted: {e}", RuntimeWarning, stacklevel=4)
            finally:
                if hold is not None:
                    hold.release()

    def _publish(self, tmp: str, *, overwrite: bool) -> tuple[str | None, DirLock | None]:
        """Move the staged directory `tmp` (manifest inside) to this location in one atomic
        step, replacing what is here when `overwrite`. Returns the path now holding what was
        displaced (to delete once the commit is durable) and the lock that keeps cleaners off
        it, or (None, None). Raises only if nothing was moved."""
        final = self.root
        st = os.lstat(tmp)
        staged_id = (st.st_dev, st.st_ino)

        def landed() -> bool:  # an error after the kernel made the rename: it happened
            try:
                now = os.lstat(final)
            except OSError:
                return False
            return (now.st_dev, now.st_ino) == staged_id

        try:
            if overwrite and os.path.lexists(final):
                if exchange(tmp, final):
                    return tmp, None  # tmp holds the previous checkpoint now
                # No atomic exchange here: the old checkpoint is moved aside (locked, so that no
                # cleaner removes it meanwhile), never modified, and moved back if the rename fails.
                old = f"{final}{TEMP_MARK}old-{secrets.token_hex(6)}"
                hold = DirLock.try_acquire(final)
                os.rename(final, old)
                try:
                    os.rename(tmp, final)
                except BaseException:
                    if not landed():
                        os.rename(old, final)
                        if hold is not None:
                            hold.release()
                        raise
                return old, hold
            rename_noreplace(tmp, final)
            return None, None
        except OSError:
            if landed():
                return (tmp if os.path.lexists(tmp) else None), None
            raise

    def staging_area(self) -> Storage:
        return self.store.parent()

    def retire(self) -> None:
        # A rename to a temporary name first (after which it is no longer a checkpoint), made
        # durable, then the removal of the files, under a lock so no cleaner races the removal.
        root = self.root
        hold = DirLock.try_acquire(root)
        try:
            retired = f"{root}{TEMP_MARK}deleted-{secrets.token_hex(6)}"
            os.rename(root, retired)
            fsync_path(os.path.dirname(root))
            remove_tree(retired)
        finally:
            if hold is not None:
                hold.release()

    # ---- leftovers and the saver lock ----------------------------------------------------

    def leftovers(self, referenced: Iterable[str] = ()) -> list[Leftover]:
        """The library's temporary directories directly below this directory, judged by their
        locks and owner records (see the module docstring)."""
        out = []
        try:
            with os.scandir(self.root) as it:
                names = [e.name for e in it if OWN_TEMP.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
        except (FileNotFoundError, NotADirectoryError):
            return []
        for name in sorted(names):
            try:
                lock = DirLock.try_acquire(os.path.join(self.root, name))
            except FileNotFoundError:
                continue  # committed or removed meanwhile
            except OSError as e:
                out.append(Leftover(name, False, f"cannot be opened ({e.strerror})"))
                continue
            if lock is None:
                owner = self._owner(name)
                out.append(Leftover(name, False, f"a save in progress holds its lock ({owner_text(owner)})", owner))
                continue
            try:
                out.append(self._judge_locked(name, lock))
            finally:
                lock.release()
        return out

    def _owner(self, name: str) -> dict | None:
        try:
            return parse_owner(self.store.get(f"{name}/{OWNER_NAME}", max_bytes=OWNER_LIMIT_BYTES))
        except (OSError, CheckpointError):
            return None

    def _judge_locked(self, name: str, lock: DirLock) -> Leftover:
        """Judge a temporary directory whose lock we hold: its saver has released it."""
        kind = OWN_TEMP.fullmatch(name).group(1)
        if kind == "deleted":
            return Leftover(name, True, "a checkpoint being deleted, which nobody is deleting any more")
        if kind == "old":
            return Leftover(name, True, "a replaced checkpoint, which nobody is removing any more")
        owner = self._owner(name)
        if owner is None:
            age = time.time() - os.fstat(lock.fd).st_mtime
            if age > UNOWNED_GRACE_S:
                return Leftover(name, True, f"no save owns it (no owner record, untouched for {age:.0f} s)")
            return Leftover(name, False, f"no owner record yet (untouched for {age:.0f} s; left alone for "
                                         f"{UNOWNED_GRACE_S:.0f} s)")
        if owner.get("boot_id") and owner.get("boot_id") == boot_id():
            return Leftover(name, True, f"its save ({owner_text(owner)}) ended without committing it", owner)
        dead, why = owner_gone(owner)
        return Leftover(name, dead, why, owner)

    def remove_leftover(self, leftover: Leftover) -> bool:
        path = os.path.join(self.root, leftover.name)
        try:
            lock = DirLock.try_acquire(path)
        except FileNotFoundError:
            return False
        if lock is None:
            return False
        try:
            if not self._judge_locked(leftover.name, lock).dead:
                return False
            remove_tree(path)  # under the lock: no other cleaner works on it meanwhile
            return True
        finally:
            lock.release()

    def remove_dead_leftovers(self, keep: Staged | None = None, *, overwrite: bool = True) -> list[str]:
        """The next save to the same parent cleans up after crashed ones."""
        area = RenameCommit(self.staging_area())
        removed = []
        try:
            for leftover in area.leftovers():
                if leftover.dead and area.remove_leftover(leftover):
                    removed.append(area.store.where(leftover.name))
        except (OSError, CheckpointError) as e:
            warnings.warn(f"could not remove leftovers of earlier saves in {area.root}: {e}", RuntimeWarning,
                          stacklevel=3)
        return removed

    def lock(self) -> SaveLock:
        self.store.make_dirs()
        lock = DirLock.try_acquire(self.root)
        if lock is None:
            raise CheckpointError(
                f"another CheckpointManager ({lock_holder(self.root)}) is saving to {self.root}: two managers cannot "
                "save to one directory (close the other one, or save to another directory)")
        return lock
