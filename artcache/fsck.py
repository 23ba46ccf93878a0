"""``artcache fsck``: find (and with ``fix``, repair) what crashes, kills and foreign hands leave in a root.

Each check reports :class:`Problem` records; with ``fix=True`` each fixable problem is repaired and
marked ``fixed``. Scope: only what artcache creates: ``artcache.json`` and the layout's subdirectories
(:data:`artcache.layout.SUBDIRS`) and, inside them, only names artcache makes; anything else in the root
(a user's own files, links and directories beside a cache in a non-empty ``--cache``) is counted in a
note and never touched.

Nothing that may belong to a live process is touched (:mod:`artcache.liveness`): a temp file or lease is
removed only when its writer/holder is provably gone (same host id, its pid no longer exists), a
registration is fenced only when its process is gone (same host id) or its heartbeat counter did not move
while fsck watched it for the root's ``heartbeat_timeout_s`` (``observe_s``) on fsck's own monotonic clock
(a process of another host or pid namespace; no clocks are compared). Temp files of writers fsck cannot
check are left to the producer (which removes them once unchanged for its lease TTL) or to an fsck on
their host. So ``fsck --fix`` is safe beside a running producer and consumers on any host: it does what
the producer's own passes would do, plus the repairs they never make.

=======================  ===========================================  ==================================
kind                     what                                          ``--fix``
=======================  ===========================================  ==================================
``symlink``              a symbolic link in artcache's part of the    unlink the link (never its target)
                         root (artcache.json, a layout subdirectory
                         or anything inside one)
``missing-dir``          a subdirectory of the layout is missing       create it (root's mode)
``orphan-temp``          ``tmp/<writer>.*`` or a plan temp dir whose   remove it
                         writer (same host id) is dead
``bad-artifact``         fails a check of ``store.read`` (content      move to ``quarantine/``
                         hash, header, shapes, token ids vs. its
                         fingerprint)
``misplaced-artifact``   an artifact under the wrong ``objects/<ab>``  move into place if it verifies and
                                                                       the place is free, else quarantine
``stale-failure``        ``failed/<fp>.json`` for a published fp, or   remove the marker
                         written by a producer that is gone
                         (superseded: the next one retries it)
``bad-registration``     ``consumers/<id>.json`` unreadable or naming  move to ``quarantine/``
                         another id
``dead-consumer``        registration ``running`` whose process is    fence it (``failed``/``expired``,
                         gone or whose heartbeat did not progress      journaled)
                         while watched
``dead-lease``           a lease whose holder is gone (same host id)   remove it (journaled
                         or whose consumer is not live                 ``lease_expire``)
``stale-lock``           a marker-file ("soft") lock left by a dead    remove it
                         process, or a lock path that is not a file
``bad-plan``             the root's plan does not load and verify      not fixable here (report only)
                         (``plan.json`` unparsable, or its digests of
                         itself and of ``plan.safetensors``)
``damaged-journal``      a journal line that is not an event, with     not fixable here (report only)
                         complete lines after it (a kill tears only
                         a file's last line: damage)
``bad-settings``         ``artcache.json`` is not a valid settings     not fixable here (report only);
                         document (e.g. truncated) or does not match   artifacts and plan left unchecked
                         the digest of its content it records
=======================  ===========================================  ==================================

Notes (not problems): temp files of live writers or other hosts, entries artcache did not write, locks
held now (``/proc/locks``), torn journal lines, quarantined files, consumers of other hosts left unjudged
(``observe_s=0``).

Fixes that the accounting sees (fences, expired leases) are journaled in
``journal/fsck-fsck-<pid>.jsonl`` so ``artcache inspect`` keeps its invariants.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import stat
import time
from pathlib import Path

import msgspec

from artcache import journal as J
from artcache import leases as leases_mod
from artcache import registry, store
from artcache.errors import (
    ArtifactMissing,
    CacheRootError,
    DataError,
    IntegrityError,
    PayloadUnavailable,
    UnsafePath,
)
from artcache.fsio import scan_temps
from artcache.layout import SETTINGS_FILE, SUBDIRS, CacheLayout, make_dir, unique_suffix
from artcache.liveness import dead_reason, from_token, in_initial_pid_namespace, pid_exists
from artcache.payload import remote_for

log = logging.getLogger("artcache.fsck")
_FP = re.compile(r"[0-9a-f]{16,128}")
#: plan.save's temp directory: .tmp-<plan id[:12]>-<writer token>.<nonce>
_PLAN_TMP = re.compile(r"\.tmp-[0-9a-f]{12}-")
#: seconds between fsck's looks at the registrations it watches for heartbeat progress
OBSERVE_POLL_S = 0.25


class Problem(msgspec.Struct, kw_only=True):
    """One finding. ``path`` is relative to the root; ``action`` says what ``--fix`` did (or would do)."""

    kind: str
    path: str
    detail: str
    fixable: bool = True
    fixed: bool = False
    action: str = ""


class FsckReport(msgspec.Struct, kw_only=True):
    """What :func:`fsck` found. ``ok``: no problem is left (none found, or every one fixed)."""

    root: str
    fix: bool
    problems: list[Problem]
    notes: list[str]
    checked: dict[str, int]

    @property
    def remaining(self) -> list[Problem]:
        return [p for p in self.problems if not p.fixed]

    @property
    def ok(self) -> bool:
        return not self.remaining


class _Fsck:
    def __init__(self, layout: CacheLayout, fix: bool, lease_ttl_s: float, observe_s: float) -> None:
        self.layout = layout
        self.fix = fix
        self.lease_ttl_s = lease_ttl_s
        self.observe_s = observe_s
        self.problems: list[Problem] = []
        self.notes: list[str] = []
        self.checked: dict[str, int] = {}
        self._journal: J.JournalWriter | None = None

    # -- helpers -----------------------------------------------------------------------------
    def rel(self, path: Path | str) -> str:
        return os.path.relpath(path, self.layout.root)

    def problem(self, kind: str, path: Path | str, detail: str, action: str, repair=None) -> Problem:
        """Record a problem; with --fix run ``repair()`` (fixable iff given). A repair that raises
        OSError leaves the problem unfixed, with the error in its detail."""
        p = Problem(kind=kind, path=self.rel(path), detail=detail, fixable=repair is not None, action=action)
        if self.fix and repair is not None:
            try:
                repair()
                p.fixed = True
            except OSError as exc:
                p.detail += f" (repair failed: {exc})"
        self.problems.append(p)
        return p

    def emit(self, ev) -> None:
        if self._journal is None:
            self._journal = J.JournalWriter(self.layout.journal_path("fsck", "fsck"))
        self._journal.emit(ev)

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()

    @staticmethod
    def real_dir(path: Path) -> bool:
        """A directory that is not a link (checks never descend into a link planted in the root)."""
        return os.path.isdir(path) and not os.path.islink(path)

    def dir_mode(self) -> int:
        """The mode for a directory fsck recreates: the root's, or 0700."""
        mode = stat.S_IMODE(os.stat(self.layout.root).st_mode)
        return mode if mode & 0o2070 == 0o2070 else 0o700

    # -- checks ------------------------------------------------------------------------------
    def check_symlinks(self) -> None:
        """Every symbolic link in artcache's part of the root: ``artcache.json``, a layout subdirectory, or
        anything inside one (never followed; the walk does not descend into links). Other entries of the
        root are not artcache's: counted in a note, never looked into."""
        n = 0
        ours = {SETTINGS_FILE, *SUBDIRS}
        foreign = 0
        for name in sorted(os.listdir(self.layout.root)):
            path = self.layout.root / name
            if name not in ours:
                foreign += 1
                continue
            n += 1
            if path.is_symlink():
                self._symlink(path)
                continue
            if not path.is_dir():
                continue
            for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
                for entry in dirnames + filenames:
                    sub = Path(dirpath) / entry
                    n += 1
                    if sub.is_symlink():
                        self._symlink(sub)
        self.checked["entries"] = n
        if foreign:
            self.notes.append(f"{foreign} entr(y/ies) in the root are not artcache's (left alone, never looked "
                              "into)")

    def _symlink(self, path: Path) -> None:
        target = os.readlink(path)
        self.problem("symlink", path, f"symbolic link to {target!r} inside the root (never followed)",
                     "unlink the link (its target is not touched)", lambda p=path: os.unlink(p))

    def check_dirs(self) -> None:
        for name in SUBDIRS:
            d = self.layout.root / name
            if os.path.islink(d):
                continue  # reported by check_symlinks (whose fix unlinks it; then it is missing, below)
            if not os.path.lexists(d):
                self.problem("missing-dir", d, f"{name}/ is missing", "create it",
                             lambda d=d: (d.mkdir(), os.chmod(d, self.dir_mode())))
            elif not d.is_dir():
                self.problem("missing-dir", d, f"{name} is not a directory", "not fixable: move it away by hand",
                             None)

    def check_tmp(self) -> None:
        seen = {"live": 0, "unknown": 0, "foreign": 0}
        entries = scan_temps(self.layout.tmp, suffix="") if self.real_dir(self.layout.tmp) else []
        self.checked["temp_files"] = len(entries)
        for entry, verdict in entries:
            if not verdict.orphan:
                seen[verdict.state] += 1
                continue
            self.problem("orphan-temp", entry.path,
                         f"temp file of pid {verdict.writer.identity.pid} (this host): {verdict.reason}",
                         "remove it", lambda p=entry.path: _unlink_missing_ok(p))
        live, other, stray = seen["live"], seen["unknown"], seen["foreign"]
        if live:
            self.notes.append(f"{live} temp file(s) in tmp/ belong to live writers on this host (left alone)")
        if other:
            self.notes.append(f"{other} temp file(s) in tmp/ were written on other hosts or pid namespaces, or "
                              "before identity tokens (their pids cannot be checked from here: a producer removes "
                              "them once unchanged for its lease TTL; or run fsck where they were written)")
        if stray:
            self.notes.append(f"{stray} file(s) in tmp/ do not have artcache's temp-file names (left alone)")
        # plan.save's temp directories
        for entry, verdict in scan_temps(self.layout.plans, prefix=_PLAN_TMP, suffix="") \
                if self.real_dir(self.layout.plans) else []:
            if not verdict.orphan or not entry.is_dir(follow_symlinks=False):
                continue
            self.problem("orphan-temp", entry.path,
                         f"plan temp directory of pid {verdict.writer.identity.pid} (this host): {verdict.reason}",
                         "remove it", lambda p=entry.path: shutil.rmtree(p))

    def check_objects(self, contract) -> set[str]:
        """Verify every artifact; returns the fingerprints published (and good) after the check."""
        if remote_for(self.layout) is not None:
            return self.check_remote_objects(contract)
        good: set[str] = set()
        verified = 0
        stray = 0
        shards = list(os.scandir(self.layout.objects)) if self.real_dir(self.layout.objects) else []
        for shard in shards:
            if shard.is_symlink():
                continue  # reported by check_symlinks
            if not shard.is_dir():
                stray += 1
                continue
            for entry in os.scandir(shard.path):
                if entry.is_symlink():
                    continue
                name = entry.name
                fp = name[: -len(".safetensors")] if name.endswith(".safetensors") else ""
                if not _FP.fullmatch(fp) or not entry.is_file():
                    stray += 1
                    continue
                if shard.name != fp[:2]:
                    self._misplaced(Path(entry.path), fp, contract, good)
                    continue
                verified += 1
                try:
                    bad = store.verify(self.layout, fp, contract)
                except (ArtifactMissing, UnsafePath):  # evicted meanwhile / a link: reported elsewhere
                    continue
                if bad is None:
                    good.add(fp)
                    continue
                self.problem("bad-artifact", entry.path, bad, "move it to quarantine/ (the producer recaptures it "
                             "on demand)", lambda fp=fp: store.quarantine(self.layout, fp))
        self.checked["artifacts"] = verified
        if stray:
            self.notes.append(f"{stray} entr(y/ies) in objects/ are not artcache artifacts (ignored by artcache, "
                              "left alone)")
        return good

    def check_remote_objects(self, contract) -> set[str]:
        """A root whose payloads are in a remote store (Mooncake): verify each manifest's payload (fetched from
        the store: hash, header, shapes, token ids); a bad one is quarantined, which also marks its key for
        removal. Payloads awaiting removal (``.pending``) are noted, not problems."""
        good: set[str] = set()
        objects = store.list_objects(self.layout)
        for fp in sorted(objects):
            try:
                bad = store.verify(self.layout, fp, contract)
            except PayloadUnavailable as exc:
                self.notes.append(f"artifact {fp} not verified: {exc}")
                continue
            except (ArtifactMissing, UnsafePath):
                continue
            if bad is None:
                good.add(fp)
                continue
            self.problem("bad-artifact", self.layout.objects / fp[:2] / f"{fp}.manifest", bad,
                         "move the manifest to quarantine/ and remove its payload (recaptured on demand)",
                         lambda fp=fp: store.quarantine(self.layout, fp))
        self.checked["artifacts"] = len(objects)
        pending = sum(1 for _ in self.layout.objects.glob("*/*.pending")) if self.real_dir(self.layout.objects) else 0
        if pending:
            self.notes.append(f"{pending} payload(s) wait for removal from the store (.pending markers; the producer "
                              "removes them once their read lease expires)")
        return good

    def _misplaced(self, path: Path, fp: str, contract, good: set[str]) -> None:
        dest = self.layout.object_path(fp)

        def repair() -> None:
            make_dir(dest.parent, exist_ok=True)
            aside = self.layout.tmp / f"{unique_suffix()}.fsck"
            os.replace(path, aside)  # verify a private copy: nobody else can swap it under us
            buf = bytearray(aside.read_bytes())
            ok = False
            try:
                store._verify(buf, fp, contract, True, check_values=True)
                ok = not os.path.lexists(dest)
            except IntegrityError:
                pass
            if ok:
                os.link(aside, dest)  # fails rather than replace an artifact published meanwhile
                os.unlink(aside)
            else:
                os.replace(aside, self.layout.quarantine / f"{fp}.{unique_suffix()}.safetensors")

        self.problem("misplaced-artifact", path, f"artifact {fp} is not under objects/{fp[:2]}/",
                     "move it into place if it verifies and the place is free, else quarantine it", repair)

    def check_failures(self, published: set[str]) -> None:
        from artcache.producer import marker_writer

        d = self.layout.root / "failed"
        for entry in list(os.scandir(d)) if self.real_dir(d) else []:
            fp = entry.name[: -len(".json")] if entry.name.endswith(".json") else ""
            if not _FP.fullmatch(fp) or entry.is_symlink():
                continue
            writer = from_token(marker_writer(entry.path))
            why = dead_reason(writer) if writer is not None and writer.comparable() else None
            if fp in published:
                detail = f"fingerprint {fp} is published, but a give-up marker remains (consumers waiting on it " \
                         "would stop)"
            elif why is not None:
                detail = f"give-up marker of a producer that is gone ({why}): superseded, the next producer " \
                         "retries the fingerprint (consumers waiting on it would stop)"
            else:
                continue
            self.problem("stale-failure", entry.path, detail, "remove the marker",
                         lambda p=entry.path: _unlink_missing_ok(p))

    def check_consumers(self, heartbeat_timeout_s: float) -> dict:
        """Registrations; returns the live (running, not dead) consumers after the check: id → identity.

        A running registration of this host id is dead when its process is gone. One whose pid cannot be
        checked (another host or pid namespace, or a legacy registration) is watched for up to
        ``observe_s`` seconds on fsck's monotonic clock: live as soon as its heartbeat counter moves, dead
        if it did not move for ``observe_s`` >= the root's heartbeat timeout (a shorter watch proves
        nothing: those stay live)."""
        live: dict = {}
        watched: dict[str, registry.Registration] = {}
        files = sorted(self.layout.consumers.glob("*.json")) if self.real_dir(self.layout.consumers) else []
        self.checked["registrations"] = len(files)
        for path in files:
            if path.is_symlink():
                continue
            cid = path.name[: -len(".json")]
            try:
                reg = msgspec.json.decode(path.read_bytes(), type=registry.Registration)
                bad = None if reg.consumer_id == cid else f"names consumer {reg.consumer_id!r}"
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                reg, bad = None, f"unreadable: {exc}"
            except FileNotFoundError:
                continue
            if bad is not None:
                self.problem("bad-registration", path, f"registration {path.name} {bad}", "move it to quarantine/",
                             lambda p=path: os.replace(p, self.layout.quarantine /
                                                       f"registration-{p.name}.{unique_suffix()}"))
                continue
            if reg.state != "running":
                continue
            if reg.identity is not None and reg.identity.comparable():
                why = dead_reason(reg.identity)
                if why is None:
                    live[reg.consumer_id] = reg.identity
                else:
                    self._dead_consumer(path, reg, "failed", f"{why} (this host)")
                continue
            watched[reg.consumer_id] = reg
        for cid, (reg, silent_s) in self._watch(watched, heartbeat_timeout_s).items():
            if silent_s is None:
                live[cid] = reg.identity
            else:
                where = reg.identity.describe() if reg.identity else f"pid {reg.pid} on {reg.host or '?'}"
                self._dead_consumer(self.layout.consumer_path(cid), reg, "expired",
                                    f"no heartbeat progress for {silent_s:.0f}s while fsck watched ({where})")
        return live

    def _watch(self, regs: dict, timeout_s: float) -> dict:
        """id → (registration, None if it is or may be live, else seconds it was watched silent)."""
        out = {cid: (reg, None) for cid, reg in regs.items()}
        if not regs:
            return out
        if self.observe_s < timeout_s:
            self.notes.append(f"{len(regs)} running consumer(s) of other hosts or pid namespaces were not judged "
                              f"(watching {self.observe_s:g}s < the root's heartbeat timeout {timeout_s:g}s "
                              "proves nothing)")
            return out
        log.info("fsck: watching the heartbeat of %d consumer(s) whose pid cannot be checked here, for up to %.0fs",
                 len(regs), self.observe_s)
        t0 = time.monotonic()
        pending = dict(regs)
        while pending and time.monotonic() - t0 < self.observe_s:
            time.sleep(OBSERVE_POLL_S)
            for cid, reg in list(pending.items()):
                try:
                    cur = registry.read(self.layout, cid)
                except UnsafePath:
                    cur = None
                if cur is None or cur.progress_token() != reg.progress_token() or cur.state != "running":
                    del pending[cid]  # progressed, re-registered or finished: not dead
        for cid, reg in pending.items():
            out[cid] = (reg, time.monotonic() - t0)
        return out

    def _dead_consumer(self, path: Path, reg, state: str, why: str) -> None:
        def repair() -> None:
            if registry.fence(self.layout, reg.consumer_id, state, f"fsck: {why}", reg.generation):
                self.emit(J.Fence(producer="fsck", consumer=reg.consumer_id, generation=reg.generation + 1,
                                  state=state, reason=f"fsck: {why}"))

        self.problem("dead-consumer", path, f"consumer {reg.consumer_id!r} is registered running but {why}",
                     f"fence it ({state}); a restart with the same id resumes from cursor {reg.cursor}", repair)

    def check_leases(self, live_consumers: dict) -> None:
        stray = 0
        names = os.listdir(self.layout.leases) if self.real_dir(self.layout.leases) else []
        self.checked["leases"] = len(names)
        for name in names:
            info = leases_mod.parse(name)
            if info is None:
                stray += 1
                continue
            reason = leases_mod.expired_reason(info, live_consumers, self.lease_ttl_s)
            if reason is None:
                continue

            def repair(info=info, reason=reason) -> None:
                if leases_mod.release(self.layout, info.name):
                    self.emit(J.LeaseExpire(producer="fsck", fp=info.fp, lease=info.name, reason=reason))

            self.problem("dead-lease", self.layout.leases / name, f"lease of consumer {info.consumer!r} (pid "
                         f"{info.pid} on {info.host}) on {info.fp[:12]}: {reason}", "remove it (journaled)", repair)
        if stray:
            self.notes.append(f"{stray} file(s) in leases/ are not lease names (left alone)")

    def check_locks(self) -> None:
        held = _held_flock_inodes()
        n_held = 0
        entries = list(os.scandir(self.layout.locks)) if self.real_dir(self.layout.locks) else []
        self.checked["lock_files"] = len(entries)
        for entry in entries:
            if entry.is_symlink():
                continue
            if not entry.is_file():
                self.problem("stale-lock", entry.path, "a lock path that is not a regular file", "not fixable: "
                             "move it away by hand", None)
                continue
            st = entry.stat()
            if st.st_ino in held:
                n_held += 1
            if st.st_size == 0:
                continue  # a flock lock file: created once, never deleted; the kernel drops dead holders
            pid, host = _soft_marker(entry.path)
            if pid is None:
                self.notes.append(f"locks/{entry.name} is not empty and not a marker lock (left alone)")
            elif host == socket.gethostname() and in_initial_pid_namespace() and not pid_exists(pid):
                # a marker names only a host name and pid: checked only from the initial pid namespace, where
                # the (older) writers of such markers ran
                self.problem("stale-lock", entry.path, f"marker (soft) lock left by pid {pid} (this host), which "
                             "is gone; it would block its lock forever", "remove it",
                             lambda p=entry.path: _unlink_missing_ok(p))
        if n_held:
            self.notes.append(f"{n_held} lock file(s) are flock-ed by live processes now")

    def check_plan(self, plan_id: str) -> None:
        from artcache.plan import Plan

        try:
            plan = Plan.load(self.layout.plan_dir(plan_id))
        except DataError as exc:
            self.problem("bad-plan", self.layout.plan_dir(plan_id), str(exc), "not fixable by fsck: move the plan "
                         "directory away and restart the producer (it rebuilds the same plan)", None)
            return
        if not plan.verified:
            self.notes.append(f"plan {plan_id[:12]} records no digests (saved before plans recorded them): its "
                              "ids and offsets were checked, its token bytes not verified")

    def check_journal(self) -> None:
        if not self.real_dir(self.layout.journal):
            return
        res = J.read_events(self.layout.journal)
        self.checked["journal_files"] = res.files
        if res.torn_lines:
            self.notes.append(f"{res.torn_lines} torn journal line(s) (a process killed mid-write; skipped by "
                              "readers)")
        for path, line in res.corrupt:
            self.problem("damaged-journal", path, f"line {line} is not a journal event and complete lines follow it "
                         "(a line torn by a killed writer can only be the last): the file was damaged, and the "
                         "accounting misses the events it held", "not fixable by fsck: restore the file from a copy "
                         "if there is one; inspect's counts stay off by its events", None)
        q = len(os.listdir(self.layout.quarantine)) if self.real_dir(self.layout.quarantine) else 0
        if q:
            self.notes.append(f"{q} file(s) in quarantine/ (kept for inspection; safe to delete)")


def fsck(root: str | os.PathLike, *, fix: bool = False, lease_ttl_s: float = 600.0,
         observe_s: float | None = None) -> FsckReport:
    """Check (and with ``fix``, repair) the cache root ``root``; see the module docstring.

    Args:
        lease_ttl_s: accepted for symmetry with the producer; a one-shot fsck never expires a lease by age
            (it cannot watch one for that long): another host's lease goes with its consumer.
        observe_s: how long to watch the heartbeat of running consumers whose pid cannot be checked here
            (default: the root's heartbeat timeout; less than that judges none of them). Only spent when
            there are such consumers, and only until each one's counter moves.

    Raises:
        CacheRootError: ``root`` is not an initialised cache root (no ``artcache.json``).
    """
    from artcache.settings import RootSettings, decode_settings

    layout = CacheLayout(Path(root).expanduser().absolute())
    if not layout.root.is_dir() or not layout.settings.is_file() or layout.settings.is_symlink():
        raise CacheRootError(f"{str(layout.root)!r} is not an initialised cache root (no {layout.settings.name})")
    # not load_settings: it refuses a root with a linked subdirectory, which fsck reports
    try:
        settings, damage = decode_settings(layout.settings.read_bytes(), layout.settings)
        heartbeat_timeout_s = settings.heartbeat_timeout_s
    except CacheRootError as exc:  # unparsable (truncated, overwritten): damaged like a tampered one
        damage = f"not a valid settings document ({str(exc).removeprefix(f'{layout.settings} is invalid: ')})"
        heartbeat_timeout_s = next(f.default for f in msgspec.structs.fields(RootSettings)
                                   if f.name == "heartbeat_timeout_s")
    run = _Fsck(layout, fix, lease_ttl_s, heartbeat_timeout_s if observe_s is None else observe_s)
    try:
        run.check_symlinks()
        run.check_dirs()
        run.check_tmp()
        if damage is None:
            if settings.digests is None:
                run.notes.append(f"{SETTINGS_FILE} records no digest (written before roots recorded one): not "
                                 "verified")
            published = run.check_objects(settings.contract)
        else:  # its contract and plan id cannot be trusted: judging artifacts by them could quarantine all
            run.problem("bad-settings", layout.settings, f"{SETTINGS_FILE} is damaged: {damage}", "not fixable by "
                        "fsck: restore it or use a new cache root", None)
            run.notes.append(f"artifacts and the plan were not checked: {SETTINGS_FILE} names their contract and "
                             "plan")
            published = set()
        run.check_failures(published)
        live = run.check_consumers(heartbeat_timeout_s)
        run.check_leases(live)
        run.check_locks()
        if damage is None:
            run.check_plan(settings.plan_id)
        run.check_journal()
    finally:
        run.close()
    return FsckReport(root=str(layout.root), fix=fix, problems=run.problems, notes=run.notes, checked=run.checked)


def format_report(rep: FsckReport) -> str:
    """Human-readable lines: one per problem, the notes, and a summary line."""
    lines = []
    for p in rep.problems:
        status = "FIXED  " if p.fixed else ("PROBLEM" if p.fixable else "MANUAL ")
        lines.append(f"{status} {p.kind:18s} {p.path}: {p.detail}" + (f" -> {p.action}" if p.fixed else ""))
    lines += [f"note    {n}" for n in rep.notes]
    checked = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in rep.checked.items())
    fixed = sum(p.fixed for p in rep.problems)
    left = len(rep.remaining)
    if not rep.problems:
        verdict = "clean"
    elif rep.fix:
        verdict = f"{len(rep.problems)} problem(s), {fixed} fixed, {left} left"
    else:
        verdict = (f"{len(rep.problems)} problem(s) (run with --fix to repair the "
                   f"{sum(p.fixable for p in rep.problems)} fixable one(s))")
    lines.append(f"fsck {rep.root}: {verdict}; checked {checked}")
    return "\n".join(lines)


def _unlink_missing_ok(path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _soft_marker(path: str) -> tuple[int | None, str]:
    """(pid, host) of a filelock marker lock file (``<pid>\\n<host>\\n[...]``), or (None, "")."""
    try:
        with open(os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), "rb") as f:
            lines = f.read(4096).decode("utf-8", "replace").splitlines()
    except OSError:
        return None, ""
    if len(lines) >= 2 and lines[0].strip().isdigit():
        return int(lines[0].strip()), lines[1].strip()
    return None, ""


def _held_flock_inodes() -> set[int]:
    """Inodes with an flock held now, from ``/proc/locks`` (Linux; empty elsewhere)."""
    out = set()
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[1] == "FLOCK":
                    with contextlib.suppress(ValueError, IndexError):
                        out.add(int(parts[5].split(":")[2]))
    except OSError:
        pass
    return out


__all__ = ["FsckReport", "Problem", "format_report", "fsck"]
