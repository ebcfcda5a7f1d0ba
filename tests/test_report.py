"""What a person reads of a run: the terminal eval table and curves.png."""

import json

from trainer.driver.report import (PASSES, TERMINAL_WIDTH, CurvesWriter, format_eval_table,
                                   plot_curves, terminal_eval_table)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _metrics(success: float) -> dict[str, float]:
    """Every pass and metric an evaluation with a train split reports."""
    m = {}
    for prefix, _ in PASSES:
        m.update({f"{prefix}/success_rate": success, f"{prefix}/raw_reward": 2 * success - 1.0,
                  f"{prefix}/mean_turns": 3.25, f"{prefix}/format_error_rate": 0.125})
    return m


def test_the_terminal_table_fits_100_columns_and_keeps_every_row():
    evals = {"initial": _metrics(0.0), "base": _metrics(0.656), "step_12": _metrics(0.8),
             "trained": _metrics(0.912)}
    full = format_eval_table(evals)
    assert max(len(line) for line in full.splitlines()) > TERMINAL_WIDTH  # why it exists
    table = terminal_eval_table(evals)
    lines = table.splitlines()
    assert max(len(line) for line in lines) <= TERMINAL_WIDTH, table
    for name, m in evals.items():  # each row with its held-out and greedy success
        row = next(line for line in lines if line.startswith(f"| {name} "))
        assert f"{m['eval/success_rate']:.1%}" in row and "train success" in lines[0]
    assert "91.2%" in table and "+0.824" in table


def test_long_model_names_keep_their_end_and_the_table_still_fits():
    name = "number_guess_cpu-20261201-121314-123456/step_000024"
    table = terminal_eval_table({name: _metrics(0.5), "base": _metrics(0.25)})
    assert max(len(line) for line in table.splitlines()) <= TERMINAL_WIDTH, table
    assert "step_000024 |" in table and "50.0%" in table


def test_a_narrow_terminal_drops_the_least_important_columns_first():
    table = terminal_eval_table({"base": _metrics(0.25)}, width=60)
    header = table.splitlines()[0]
    assert max(len(line) for line in table.splitlines()) <= 60, table
    assert "success" in header and "format err" not in header


def test_curves_png_has_the_training_and_eval_curves(tmp_path):
    rows = [{"step": 0, **{f"initial/{k}": v for k, v in _metrics(0.0).items()}},
            {"step": 0, **{f"base/{k}": v for k, v in _metrics(0.5).items()}}]
    rows += [{"step": s, "rollout/raw_reward": 0.1 * s, "rollout/success_rate": 0.2 * s,
              **_mismatch_row(s)} for s in range(1, 5)]
    rows += [{"step": 4, **{f"trained/{k}": v for k, v in _metrics(0.75).items()}}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows)
                                            + '{"step": 5, "rollout/raw')  # cut short by a crash
    out = plot_curves(tmp_path)
    assert out == tmp_path / "curves.png"
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    from PIL import Image  # matplotlib's own dependency

    with Image.open(out) as img:
        img.verify()
        width, height = img.size
    # 2 rollout + 4 eval + 3 mismatch panels (gap, ratios, cut): three rows of three
    assert width > height > 900


def test_the_driver_redraws_curves_only_when_the_metrics_changed(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "rollout/raw_reward": 0.5}) + "\n")
    curves = CurvesWriter(tmp_path)
    png = curves.write()
    png.write_bytes(b"stale")  # a redraw would overwrite it
    assert curves.write() == png and png.read_bytes() == b"stale"
    with metrics.open("a") as f:
        f.write(json.dumps({"step": 2, "rollout/raw_reward": 0.7}) + "\n")
    assert curves.write() == png and png.read_bytes().startswith(PNG_MAGIC)


def test_curves_are_drawn_once_there_is_something_to_draw(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 0, "perf/setup_time": 3.0}) + "\n")  # no panel
    curves = CurvesWriter(tmp_path)
    assert curves.write() is None and curves.write() is None
    assert not (tmp_path / "curves.png").exists()


def test_no_metrics_yet_means_no_plot(tmp_path):
    assert plot_curves(tmp_path) is None and not (tmp_path / "curves.png").exists()


def _mismatch_row(step: int) -> dict[str, float]:
    return {"mismatch/logprob_abs_diff": 0.0 if step == 1 else 0.01 * step,  # 0: fp32 engines
            "mismatch/logprob_abs_diff_max": 0.3, "mismatch/k3_kl": 1e-4 * step,
            **{f"mismatch/{level}_ratio_{q}": v for level in ("token", "seq")
               for q, v in (("p1", 0.8), ("p50", 1.0), ("p99", 1.3))},
            "mismatch/token_masked_frac": 0.01, "mismatch/seq_masked_frac": 0.1,
            "mismatch/staleness_mean": 0.0, "mismatch/staleness_max": 0.0}


def test_mismatch_panels_show_what_the_run_logged():
    """Gap, importance-ratio quantiles and what the correction cut, every step; staleness
    only once a batch was stale."""
    from trainer.driver.report import _mismatch_panels

    series: dict = {}
    for step in range(1, 5):
        for key, value in _mismatch_row(step).items():
            series.setdefault(key, {})[step] = value
    panels = _mismatch_panels(series)
    assert [p[0] for p in panels] == ["train/rollout gap", "importance ratio pi_train / pi_rollout",
                                      "cut by the rollout correction"]
    assert [k for k, _ in panels[2][1]] == ["mismatch/token_masked_frac", "mismatch/seq_masked_frac"]
    series["mismatch/staleness_max"][3] = 2.0
    assert _mismatch_panels(series)[-1][0].startswith("staleness")
