"""Every artcache error pickles with its attributes and maps to the CLI exit status of its kind."""

from __future__ import annotations

import errno
import inspect
import pickle

import filelock
import pytest

from artcache import errors
from artcache.errors import ArtcacheError

# the bad-input kinds (exit 2); everything else is an operational failure (exit 1)
BAD_INPUT = {"ConfigError", "InsufficientSpace", "DataError", "CacheRootError", "ContractMismatch"}
KEYWORDS = {  # a value for every keyword an error's __init__ requires
    "fingerprint": "ab" * 32, "attempts": 3, "retryable": True, "errno_": errno.ENOSPC, "step": 7,
    "last_good": "/runs/d16/checkpoints/step-00000002", "rank": 1, "returncode": -9,
}


def error_classes() -> list[type[ArtcacheError]]:
    return [obj for _, obj in inspect.getmembers(errors, inspect.isclass)
            if issubclass(obj, ArtcacheError) and obj.__module__ == errors.__name__
            and not obj.__name__.startswith("_")]


def make(cls: type[ArtcacheError]) -> ArtcacheError:
    params = inspect.signature(cls.__init__).parameters
    if "lock_file" in params:
        return cls("/cache/locks/x.lock")
    kwargs = {name: KEYWORDS[name] for name, p in params.items() if p.kind is p.KEYWORD_ONLY}
    return cls("the message", **kwargs)


@pytest.mark.parametrize("cls", error_classes(), ids=lambda c: c.__name__)
def test_every_error_pickles_with_its_attributes(cls):
    exc = make(cls)
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is cls
    assert str(back) == str(exc)
    assert back.retryable == exc.retryable
    for name in ("fingerprint", "attempts", "errno", "lock_file", "last_good", "rank", "returncode"):
        assert getattr(back, name, None) == getattr(exc, name, None), name


@pytest.mark.parametrize("cls", error_classes(), ids=lambda c: c.__name__)
def test_every_error_maps_to_its_exit_code(cls):
    assert cls.exit_code == (2 if cls.__name__ in BAD_INPUT else 1)


def test_regression_integrity_error_is_an_operational_failure():
    """A corrupt artifact exited 2 (bad input) because IntegrityError is a ValueError; it is a failure."""
    assert issubclass(errors.IntegrityError, ValueError) and errors.IntegrityError.exit_code == 1


def test_regression_lock_timeout_is_raised_inside_the_tree(tmp_path):
    """The lock layer raised filelock.Timeout, outside the artcache tree, and LockTimeout was dead."""
    from artcache.locking import cache_lock

    path = tmp_path / "x.lock"
    held = cache_lock(path, thread_local=False)
    held.acquire()
    try:
        with pytest.raises(errors.LockTimeout) as info:
            cache_lock(path, timeout=0).acquire()
        assert isinstance(info.value, filelock.Timeout) and isinstance(info.value, TimeoutError)
        assert info.value.lock_file == str(path)
    finally:
        held.release()


def test_the_cli_exits_with_the_error_class_code(tmp_path):
    from click.testing import CliRunner

    from artcache.app.cli import main

    res = CliRunner().invoke(main, ["inspect", "--cache", str(tmp_path / "missing")])
    assert res.exit_code == 2 and "artcache: error:" in res.output
