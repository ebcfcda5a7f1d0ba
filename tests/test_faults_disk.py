"""Disk faults: an unwritable or full output directory is a clear error before training
starts, and a checkpoint save that fails (disk full mid-write, for real) leaves the previous
checkpoint intact and ``latest()`` unchanged. Fast: no Ray, no engines."""

import errno
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import REPO, main_exit
from trainer.driver.checkpoint import (MARKER, CheckpointError, CheckpointManager,
                                       preflight_output_dir)



def _save(mgr, step, payload=None, fail=None):
    def save_train(d):
        d.mkdir(parents=True)
        torch.save(payload if payload is not None else {"w": torch.full((4,), float(step))},
                   d / "model.pt")
        if fail is not None:
            raise fail
    return mgr.save(step, save_train=save_train, export_hf=None,
                    rollout_state={"pos": step}, meta={"weight_version": step})


def test_preflight_rejects_a_path_that_cannot_be_a_directory(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the run directory's parent should be")
    with pytest.raises(CheckpointError, match="logging.output_dir: cannot write"):
        preflight_output_dir(blocker / "run", min_free_bytes=0)


def test_preflight_rejects_a_read_only_directory():
    # Outside tmp_path (pytest's tree is private to its user) so an unprivileged user can
    # reach the directory; as root, permission bits only bind once the check drops to one.
    base = Path(tempfile.mkdtemp(prefix="hg-ro-"))
    try:
        base.chmod(0o755)
        ro = base / "ro"
        ro.mkdir(mode=0o555)
        ro.chmod(0o555)
        error = _as_unprivileged_user(lambda: preflight_output_dir(ro / "run", min_free_bytes=0))
        assert error.startswith("CheckpointError: logging.output_dir: cannot write"), error
        assert "Permission denied" in error
        assert not (ro / "run").exists()
    finally:
        shutil.rmtree(base)


def _as_unprivileged_user(fn) -> str:
    """``type: message`` of what ``fn`` raises, run as user nobody when this is root."""
    if os.geteuid() != 0:
        try:
            fn()
        except Exception as err:
            return f"{type(err).__name__}: {err}"
        return "no error"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: drop to nobody, report, exit without running pytest's teardown
        try:
            os.setgid(65534)
            os.setuid(65534)
            fn()
            result = "no error"
        except Exception as err:
            result = f"{type(err).__name__}: {err}"
        os.write(write, result.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        result = f.read()
    os.waitpid(pid, 0)
    return result


def test_preflight_rejects_too_little_free_space(tmp_path):
    with pytest.raises(CheckpointError, match="MiB free"):
        preflight_output_dir(tmp_path / "run", min_free_bytes=1 << 62)


@pytest.mark.subprocess
def test_trainer_main_stops_before_training_on_an_unwritable_run_dir(tmp_path):
    """Start-up check through the real entry point: the run directory cannot be created
    (a file is in the way): a message naming the key, a non-zero exit, no Ray started."""
    (tmp_path / "blocker").write_text("")
    proc = main_exit(tmp_path, f"logging.output_dir={tmp_path}", "logging.run_name=blocker")
    out = proc.stderr + proc.stdout
    assert proc.returncode != 0
    assert "logging.output_dir: cannot write" in out
    assert "Started a local Ray instance" not in out


@pytest.mark.subprocess
def test_trainer_main_unwritable_output_dir_is_a_one_line_error(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    proc = main_exit(tmp_path, f"logging.output_dir={blocker}", "logging.run_name=x")
    assert proc.returncode == 2
    assert "homegym: logging.output_dir: cannot write" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("fault", [OSError(errno.ENOSPC, "No space left on device"),
                                   RuntimeError("rank 1: file write failed")])
def test_failed_save_keeps_previous_checkpoint_and_latest(tmp_path, fault):
    mgr = CheckpointManager(tmp_path)
    first = _save(mgr, 1)
    assert mgr.latest() == first
    with pytest.raises(CheckpointError, match="saving checkpoint step 2"):
        _save(mgr, 2, fail=fault)
    assert mgr.latest() == first
    assert (mgr.root / "latest").resolve() == first.resolve()
    assert (first / MARKER).exists()
    assert torch.load(first / "train" / "model.pt")["w"].tolist() == [1.0] * 4
    assert not (mgr.root / "step_000002").exists()
    assert mgr.resolve_resume("auto") == first


@pytest.mark.parametrize("fault", [OSError(errno.ENOSPC, "No space left on device"),
                                   RuntimeError("[enforce fail at inline_container.cc:672] "
                                                "unexpected pos")])
def test_failed_save_is_a_clear_error_and_leaves_no_partial_directory(tmp_path, fault):
    mgr = CheckpointManager(tmp_path)
    _save(mgr, 1)
    with pytest.raises(CheckpointError, match="previous checkpoint is intact"):
        _save(mgr, 2, fail=fault)
    assert sorted(p.name for p in mgr.root.iterdir()) == ["latest", "step_000001"]


@pytest.mark.subprocess
def test_disk_full_mid_write_for_real(tmp_path):
    """A real write failure: the saving process's file-size limit (RLIMIT_FSIZE) stops
    torch.save half-way through the second checkpoint, as a full disk would."""
    script = textwrap.dedent(f"""
        import resource, signal, sys, torch
        sys.path.insert(0, {str(REPO)!r})
        from pathlib import Path
        from trainer.driver.checkpoint import CheckpointManager
        mgr = CheckpointManager(Path({str(tmp_path)!r}))
        def saver(n):
            def save_train(d):
                d.mkdir(parents=True)
                torch.save({{"w": torch.ones(n)}}, d / "model.pt")
            return save_train
        mgr.save(1, save_train=saver(16), export_hf=None, rollout_state={{}}, meta={{}})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        try:
            mgr.save(2, save_train=saver(1 << 20), export_hf=None, rollout_state={{}}, meta={{}})
        except Exception as err:
            print("SAVE FAILED:", type(err).__name__, err)
        else:
            print("SAVE SUCCEEDED")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert "SAVE FAILED: CheckpointError" in proc.stdout, proc.stdout + proc.stderr
    mgr = CheckpointManager(tmp_path)
    assert mgr.latest() == mgr.root / "step_000001"
    assert (mgr.root / "latest").resolve().name == "step_000001"
    assert torch.load(mgr.latest() / "train" / "model.pt")["w"].numel() == 16


def test_resume_setting_picks_the_checkpoint(tmp_path):
    """train.resume: `auto` takes this run's latest complete checkpoint, `never` none even
    when one exists, a path exactly that checkpoint; an incomplete or missing path is a
    named error."""
    mgr = CheckpointManager(tmp_path / "run")
    assert mgr.resolve_resume("auto") is None  # a new run
    first, second = _save(mgr, 1), _save(mgr, 2)
    assert mgr.resolve_resume("auto") == second
    assert mgr.resolve_resume("never") is None
    assert Path(mgr.resolve_resume(str(first))).resolve() == first.resolve()
    (first / MARKER).unlink()  # as a save cut short would leave it
    with pytest.raises(CheckpointError, match="train.resume: .* not a complete checkpoint"):
        mgr.resolve_resume(str(first))
    with pytest.raises(CheckpointError, match="train.resume"):
        mgr.resolve_resume(str(tmp_path / "nowhere"))
