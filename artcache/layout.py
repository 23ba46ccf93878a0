"""The on-disk layout of one cache root, and the only place paths are built.

::

    ROOT/
      artcache.json                      settings every process must agree on (RootSettings)
      plans/<plan_id>/                   the plan (tokens, loss masks, provenance)
      objects/<ab>/<fp>.safetensors      published artifacts
      locks/                             lock files: created once, never deleted
      tmp/                               partial writes: <host>.<pid>.<nonce>.<suffix>
      consumers/<id>.json                registrations
      leases/<fp>~<consumer>~<host>~<pid>~<nonce>   one file per held lease
      journal/<role>-<id>-<pid>.jsonl    accounting events, one writer per file
      quarantine/                        artifacts that failed their content check
      failed/<fp>.json                   fingerprints the producer gave up on (error, attempts)

Path components are built only from hex digests and validated ids (``[A-Za-z0-9_.-]``, 1–64
characters, not starting with a dot); nothing from data or config is used unchecked.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

from artcache.errors import CacheRootError, ConfigError

_HEX = re.compile(r"^[0-9a-f]{16,128}$")
_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
SETTINGS_FILE = "artcache.json"
SUBDIRS = ("plans", "objects", "locks", "tmp", "consumers", "leases", "journal", "quarantine", "failed")


def check_fingerprint(fp: str) -> str:
    """Return ``fp`` if it is a lower-case hex digest (16–128 chars); raise ConfigError otherwise."""
    if not isinstance(fp, str) or not _HEX.fullmatch(fp):  # fullmatch: "$" would accept a trailing newline
        raise ConfigError(f"invalid fingerprint {fp!r}: expected 16-128 lower-case hex digits")
    return fp


def check_id(value: str, what: str = "id") -> str:
    """Return ``value`` if it is a safe path component; raise ConfigError naming it otherwise.

    Accepted: 1–64 characters of ``A-Z a-z 0-9 _ . -``, not starting with ``.`` or ``-``.
    """
    if not isinstance(value, str) or not _ID.fullmatch(value) or "~" in value:
        raise ConfigError(
            f"invalid {what} {value!r}: use 1-64 characters from A-Z a-z 0-9 _ . - "
            "(not starting with '.' or '-')")
    return value


def host_id() -> str:
    """This host's name reduced to a safe path component."""
    name = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:32] or "host"
    return name


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (signal 0; a PermissionError means it exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def unique_suffix() -> str:
    """``<host>.<pid>.<nonce>``: unique among all writers sharing a filesystem."""
    return f"{host_id()}.{os.getpid()}.{secrets.token_hex(6)}"


@dataclass(frozen=True)
class CacheLayout:
    """Paths inside one cache root. Constructing it touches nothing on disk."""

    root: Path

    @property
    def settings(self) -> Path:
        return self.root / SETTINGS_FILE

    def sub(self, name: str) -> Path:
        return self.root / name

    @property
    def objects(self) -> Path:
        return self.root / "objects"

    @property
    def locks(self) -> Path:
        return self.root / "locks"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def plans(self) -> Path:
        return self.root / "plans"

    @property
    def consumers(self) -> Path:
        return self.root / "consumers"

    @property
    def leases(self) -> Path:
        return self.root / "leases"

    @property
    def journal(self) -> Path:
        return self.root / "journal"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    def failure_path(self, fp: str) -> Path:
        """``failed/<fp>.json``: the producer gave up on ``fp``; a consumer waiting on it stops."""
        return self.root / "failed" / f"{check_fingerprint(fp)}.json"

    def object_path(self, fp: str) -> Path:
        check_fingerprint(fp)
        return self.objects / fp[:2] / f"{fp}.safetensors"

    def lock_path(self, name: str) -> Path:
        return self.locks / f"{check_id(name, 'lock name')}.lock"

    def fingerprint_lock(self, fp: str, stripes: int = 4096) -> Path:
        """The striped capture lock for ``fp``: ``locks/fp-<stripe>.lock`` (bounded file count)."""
        check_fingerprint(fp)
        return self.locks / f"fp-{int(fp[:8], 16) % stripes:04x}.lock"

    def consumer_path(self, consumer_id: str) -> Path:
        return self.consumers / f"{check_id(consumer_id, 'consumer id')}.json"

    def consumer_lock(self, consumer_id: str) -> Path:
        return self.locks / f"consumer-{check_id(consumer_id, 'consumer id')}.lock"

    def journal_path(self, role: str, ident: str) -> Path:
        check_id(role, "role")
        check_id(ident, "journal id")
        return self.journal / f"{role}-{ident}-{os.getpid()}.jsonl"

    def tmp_path(self, suffix: str) -> Path:
        return self.tmp / f"{unique_suffix()}.{suffix}"

    def plan_dir(self, plan_id: str) -> Path:
        return self.plans / check_fingerprint(plan_id)

    def create(self) -> list[Path]:
        """Create the root (and missing parents) and its subdirectories, idempotently.

        Returns the directories this call created, outermost first, so a caller that fails later
        can remove exactly those and leave nothing behind."""
        missing = []
        p = self.root
        while not p.exists():
            missing.append(p)
            if p.parent == p:
                break
            p = p.parent
        missing.reverse()
        self.root.mkdir(parents=True, exist_ok=True)
        for name in SUBDIRS:
            d = self.root / name
            if not d.exists():
                missing.append(d)
            d.mkdir(exist_ok=True)
        return missing

    def require(self) -> None:
        """Raise CacheRootError unless the root exists and has been initialised by a producer."""
        if not self.root.is_dir():
            raise CacheRootError(
                f"cache root {str(self.root)!r} does not exist; start `artcache producer --cache "
                f"{self.root}` first (it creates and initialises the root)")
        if not self.settings.is_file():
            raise CacheRootError(
                f"cache root {str(self.root)!r} has no {SETTINGS_FILE}: it was not initialised by "
                "`artcache producer`")
        for name in SUBDIRS:
            if not (self.root / name).is_dir():
                raise CacheRootError(f"cache root {str(self.root)!r} is missing {name}/")
