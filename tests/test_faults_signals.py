"""The driver's signal handling (trainer.driver.runtime.Runtime), in-process and fast: SIGTERM and
SIGINT unwind the driver (KeyboardInterrupt, so teardown runs); with ``defer_stop`` the
first signal only requests a stop at the next step boundary and a second one stops at
once; teardown ignores further signals; the previous handlers come back afterwards."""

import os
import signal

import pytest

from config import HomegymConfig, RolloutConfig
from trainer.driver.runtime import Runtime


def _runtime(tmp_path):
    rt = Runtime(HomegymConfig(rollout=RolloutConfig(num_engines=1)), tmp_path)
    rt._install_signal_handlers()
    return rt


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_unwinds_and_handlers_are_restored(tmp_path, sig):
    before = signal.getsignal(sig)
    rt = _runtime(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), sig)  # handled at the next bytecode boundary
        for _ in range(1000):
            pass
    rt.close()
    assert signal.getsignal(sig) == before


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_deferred_stop_first_signal_requests_second_stops(tmp_path, sig, capsys):
    rt = _runtime(tmp_path)
    rt.defer_stop = True
    try:
        os.kill(os.getpid(), sig)  # handled at the next bytecode boundary
        for _ in range(1000):
            if rt.stop_requested:
                break
        assert rt.stop_requested
        assert "finishing the current step" in capsys.readouterr().out
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), sig)
            for _ in range(1000):
                pass
    finally:
        rt.close()


def test_teardown_ignores_further_signals(tmp_path):
    rt = _runtime(tmp_path)

    class SignalsDuringShutdown:
        def shutdown(self):
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
            self.done = True

    part = SignalsDuringShutdown()
    rt.engines = part
    rt.close()  # no KeyboardInterrupt escapes, and the teardown finished
    assert part.done and rt.engines is None
