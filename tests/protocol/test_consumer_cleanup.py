"""A consumer that cannot write what it must (a full disk under ``checkpoints/latest``, a shared-memory ring for
``--reader process`` that cannot be allocated, a read-only root) stops in one line and leaves nothing behind
(real processes on the tiny target, faults injected by tests/support/faultinject or a read-only bind mount)."""

from __future__ import annotations

import pytest


def test_regression_a_failed_latest_link_leaves_no_temp_link_and_names_the_checkpoint(tmp_path, monkeypatch):
    """ENOSPC while replacing ``checkpoints/latest`` (after the checkpoint itself was complete) raised a raw
    OSError and left the ``.latest-*`` temp link behind; now it is a CheckpointWriteError naming the complete
    checkpoint and the link, the temp link is removed and ``latest`` still points where it did."""
    import errno
    import os

    from artcache.errors import CheckpointWriteError
    from artcache.trainers import checkpoint as ck

    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / "step-00000001").mkdir(parents=True)
    (ckpts / "step-00000002").mkdir()
    ck.point_latest(tmp_path / "run", ckpts / "step-00000001")
    real = os.replace

    def full(src, dst, *a, **k):
        if ".latest-" in str(src):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(src))
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(CheckpointWriteError, match=r"step-00000002 is complete, but checkpoints/latest could not be "
                                                  r"pointed at it \(ENOSPC.*it points at step-00000001 as before"):
        ck.point_latest(tmp_path / "run", ckpts / "step-00000002")
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-00000001", "step-00000002"]
    assert os.readlink(ckpts / "latest") == "step-00000001"
