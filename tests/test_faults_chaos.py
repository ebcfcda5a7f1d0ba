"""The chaos soak, short (scripts/chaos_soak.py runs the long one): an async run of 8 steps
with an engine server SIGKILLed, the training rank SIGKILLed (crash, then resume) and one
SIGTERM (graceful stop, then resume). It finishes every step, and its prompt ledger shows
no group trained twice and every row of each completed epoch accounted for."""

import importlib.util
import sys

import pytest

from conftest import REPO, read_jsonl

pytestmark = pytest.mark.slow


def chaos_module():
    spec = importlib.util.spec_from_file_location("chaos_soak", REPO / "scripts" / "chaos_soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("chaos_soak", module)
    spec.loader.exec_module(sys.modules["chaos_soak"])
    return sys.modules["chaos_soak"]


def test_short_chaos_soak_async_trains_every_group_exactly_once(tmp_path):
    chaos = chaos_module()
    figures = chaos.soak(tmp_path, "async", steps=8, engine_kills=1, kill_rank_at=3,
                         sigterm_at=6, reference=False, seed=1, timeout_s=600)
    print(figures.report())
    assert figures.engine_kills == 1 and figures.rank_kills == 1 and figures.sigterms == 1
    assert figures.launches == 3
    assert figures.engine_restarts >= 1
    assert figures.ledger["ledger/trained_twice"] == 0
    # 8 steps x 2 groups, each trained once in the final lineage; 10 rows: epoch 0 whole.
    assert figures.ledger["ledger/trained"] == 16
    run_dir = tmp_path / "async-chaos"
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "perf/train_time" in r]
    assert max(steps) == 8 and set(steps) == set(range(1, 9))
