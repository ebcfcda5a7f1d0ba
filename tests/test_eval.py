"""trainer/eval.py: evaluating models side by side on an environment's eval split."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.eval import _label, evaluate_models, write_results

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["rollout.num_engines=1", "eval.n_samples_per_prompt=1", "eval.greedy=false",
         "logging.wandb_mode=disabled"]


def _fake_run(tmp_path: Path, model_dir: str) -> Path:
    run = tmp_path / "run"
    shutil.copytree(model_dir, run / "checkpoints" / "step_000003" / "hf")
    (run / "checkpoints" / "latest").symlink_to("step_000003")
    return run


def test_labels():
    assert _label("base") == "base"
    assert _label("/o/run-1/checkpoints/step_000003/hf") == "run-1/step_000003"
    assert _label("/o/run-1", "/o/run-1/checkpoints/step_000003/hf") == "run-1/step_000003"
    assert _label("/models/x") == "/models/x"


def test_write_results_table(tmp_path):
    metrics = {"eval/success_rate": 0.5, "eval/raw_reward": 0.25, "eval/mean_turns": 3.0,
               "eval/format_error_rate": 0.1}
    results = {"base": {"metrics": metrics, "rows": [{"a": 1}], "model_path": "tiny"},
               "run/ckpt": {"metrics": metrics, "rows": [], "model_path": "/x"}}
    table = write_results(results, tmp_path / "t" / "table.md")
    assert "| base | 50.0% | +0.250 | 3.00 | 10.0%" in table
    assert (tmp_path / "t" / "eval.json").exists() and (tmp_path / "t" / "0_base.jsonl").exists()


@pytest.mark.slow
def test_base_vs_checkpoint_side_by_side(ray_local, tmp_path, tiny_model_path):
    run = _fake_run(tmp_path, tiny_model_path)
    results = evaluate_models(["base", str(run)], SMALL, quiet=True)
    assert list(results) == ["base", "run/step_000003"]
    for r in results.values():
        m = r["metrics"]
        for key in ("eval/success_rate", "eval/raw_reward", "eval/mean_turns",
                    "eval/format_error_rate"):
            assert key in m, sorted(m)
        assert len(r["rows"]) == 10  # the 10 even targets, one sample each
    # Same weights, greedy-free sampling aside: both are evaluated on the same prompts.
    paths = [r["model_path"] for r in results.values()]
    assert paths[0] == "tiny-qwen3" and paths[1].endswith("step_000003/hf")


@pytest.mark.slow
def test_eval_cli(tmp_path, tiny_model_path):
    run = _fake_run(tmp_path, tiny_model_path)
    out = tmp_path / "cmp" / "table.md"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "trainer.eval", "+recipe=number_guess_cpu",
                           f"checkpoint={run}", "compare=base", f"out={out}", *SMALL],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    table = out.read_text()
    assert table.count("\n") == 4 and "| base |" in table
    assert set(json.loads((out.parent / "eval.json").read_text())) >= {"base"}
    bad = subprocess.run([sys.executable, "-m", "trainer.eval", f"checkpoint={tmp_path}/none"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "checkpoint=" in bad.stderr
