"""trainer/eval.py: evaluating models side by side on an environment's eval split."""

import json
import sys
from pathlib import Path

import pytest

from conftest import REPO, clean_env, fake_run_dir, run_group
from trainer.eval import _label, write_results

SMALL = ["rollout.num_engines=1", "eval.n_samples_per_prompt=1", "eval.greedy=false",
         "logging.wandb_mode=disabled"]


def _fake_run(tmp_path: Path, model_dir: str, *, perturb: bool = False) -> Path:
    """A run directory whose latest checkpoint is ``model_dir``'s model, or (``perturb``)
    that model with noise added to every weight: a different policy."""
    run = fake_run_dir(tmp_path, model_dir, step=3)
    hf = run / "checkpoints" / "step_000003" / "hf"
    if perturb:
        import torch
        from safetensors.torch import load_file, save_file

        gen = torch.Generator().manual_seed(0)
        weights = load_file(str(hf / "model.safetensors"))
        # A fresh draw of every non-constant tensor at its own scale (norm weights stay).
        save_file({k: (v.std() * torch.randn(v.shape, generator=gen) + v.mean()).contiguous()
                   if v.numel() > 1 and v.std() > 0 else v for k, v in weights.items()},
                  str(hf / "model.safetensors"), metadata={"format": "pt"})
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
def test_eval_cli_plays_base_and_checkpoint_side_by_side(tmp_path, tiny_model_path, ray_address):
    """``python -m trainer.eval checkpoint=<run> compare=base`` (joining the session's Ray
    instance): each model is evaluated with its own weights on the same, paired games,
    and the table, eval.json and per-sample rows are written; a checkpoint that does not
    exist is a one-line error, exit 2."""
    run = _fake_run(tmp_path, tiny_model_path, perturb=True)
    out = tmp_path / "cmp" / "table.md"
    env = dict(clean_env(), RAY_ADDRESS=ray_address)
    proc = run_group([sys.executable, "-m", "trainer.eval", "+recipe=number_guess_cpu",
                      f"checkpoint={run}", "compare=base", f"out={out}",
                      *[o for o in SMALL if not o.startswith("eval.greedy=")], "eval.greedy=true"],
                     cwd=REPO, env=env, timeout_s=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    table = out.read_text()
    assert table.count("\n") == 4 and "| base |" in table
    evals = json.loads((out.parent / "eval.json").read_text())
    assert list(evals) == ["run/step_000003", "base"]
    ckpt, base = evals["run/step_000003"], evals["base"]
    assert base["model_path"] == "tiny-qwen3" and ckpt["model_path"].endswith("step_000003/hf")
    rows = {}
    for label, path in (("run/step_000003", "0_run_step_000003.jsonl"), ("base", "1_base.jsonl")):
        rows[label] = [json.loads(line) for line in (out.parent / path).read_text().splitlines()]
        # The 10 even targets, one sampled and one greedy game each.
        assert len(rows[label]) == 20
        for prefix in ("eval", "eval_greedy"):
            rewards = [row["reward"] for row in rows[label] if row["pass"] == prefix]
            assert len(rewards) == 10
            assert evals[label]["metrics"][f"{prefix}/raw_reward"] == pytest.approx(sum(rewards) / 10)
            for key in ("success_rate", "mean_turns", "format_error_rate"):
                assert f"{prefix}/{key}" in evals[label]["metrics"], sorted(evals[label]["metrics"])
    # Side by side: the same games in the same order for both models...
    key = [(row["pass"], row["group"], json.dumps(row["label"])) for row in rows["base"]]
    assert key == [(row["pass"], row["group"], json.dumps(row["label"]))
                   for row in rows["run/step_000003"]]
    # ...played by different policies. Greedy games and sampled ones (eval.seed pairs the
    # draws: the same seed per game for both models) would be identical had the checkpoint's
    # weights not been the ones evaluated.
    assert [row["response"] for row in rows["base"]] != \
        [row["response"] for row in rows["run/step_000003"]]
    bad = run_group([sys.executable, "-m", "trainer.eval", f"checkpoint={tmp_path}/none"],
                    cwd=REPO, env=env, timeout_s=120)
    assert bad.returncode == 2 and "checkpoint=" in bad.stderr
