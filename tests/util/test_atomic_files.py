"""tf_nvlink.util.atomic_files: a kill never leaves a torn file; file modes (user-only cache, the umask elsewhere)."""

import os
import stat
from pathlib import Path

import pytest

from tf_nvlink.plan import tune_cache
from tf_nvlink.util import atomic_files


def test_write_atomic_keeps_the_old_file_when_killed(tmp_path, monkeypatch):
    path = tmp_path / "results.json"
    atomic_files.write_atomic(str(path), '{"old": true}\n')

    class Killed(BaseException):
        pass

    def killed(*args):
        raise Killed()

    monkeypatch.setattr(tune_cache.os, "replace", killed)
    with pytest.raises(Killed):
        atomic_files.write_atomic(str(path), '{"new": true}\n')
    monkeypatch.undo()
    assert path.read_text() == '{"old": true}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]  # the temporary went too


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_file_modes_cache_user_only_other_writes_follow_the_umask(tmp_path, umask):
    """The cache is user-only whatever the umask; write_atomic(mode=None) honours the umask like open()."""
    old = os.umask(umask)
    try:
        key = tune_cache.store(_record(), path=str(tmp_path / "cache" / "autotune.json"))
        atomic_files.write_atomic(str(tmp_path / "shared.json"), "{}\n", mode=None)
        with atomic_files.atomic_path(str(tmp_path / "model.keras"), suffix=".keras") as partial:
            assert partial.endswith(".keras") and Path(partial).name.startswith(".model.keras.")
            Path(partial).write_bytes(b"zip")
    finally:
        os.umask(old)
    assert key in tune_cache.entries(str(tmp_path / "cache" / "autotune.json"))
    assert stat.S_IMODE((tmp_path / "cache").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "cache" / "autotune.json").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "cache" / "autotune.json.lock").stat().st_mode) & 0o077 == 0
    assert stat.S_IMODE((tmp_path / "shared.json").stat().st_mode) == 0o666 & ~umask
    assert stat.S_IMODE((tmp_path / "model.keras").stat().st_mode) == 0o666 & ~umask
    assert not list(tmp_path.rglob(".*"))  # no temporary left anywhere


def _record():
    return {"fingerprint": "abc123", "tf_version": "2.21.0", "gpus": [0, 1], "candidate": "nccl:1",
            "cross_device_ops": "nccl", "num_packs": 1, "score": 200.0, "sizes": [1024], "scores": {"nccl:1": 200.0},
            "n_replicas": 2, "measured_at": "2026-11-30T00:00:00+00:00"}
