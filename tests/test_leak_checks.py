"""The suite's own leak check (conftest.no_leaked_actors_or_servers) knows a server process
across its snapshots even after the wall clock moved: psutil's create_time moves with it,
and a session's shared engines were once taken for a test's leftovers and killed."""

import subprocess
import sys

import psutil
import pytest

import conftest

pytestmark = pytest.mark.subprocess


def _fake_server():
    # A process whose command line carries a server marker, as the check looks for them.
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                             "sglang_router"])


def test_a_server_from_before_is_the_same_server_after_the_clock_moves(monkeypatch):
    proc = _fake_server()
    try:
        before = conftest._servers()
        assert any(pid == proc.pid for pid, _ in before)
        real = psutil._psplatform.boot_time
        monkeypatch.setattr(psutil._psplatform, "boot_time", lambda: real() + 1.0)
        assert conftest._servers() == before
    finally:
        proc.kill()
        proc.wait()

