"""What a person reads of a run: the evaluation table and the curves plot.

- ``format_eval_table``: every column (sampled, greedy, train-split passes) as markdown;
  the run directory's eval_table.md.
- ``terminal_eval_table``: the same rows in at most 100 columns for the console, the
  least important columns dropped first.
- ``plot_curves``: ``<run_dir>/curves.png`` from metrics.jsonl: rollout reward and success
  per step, each evaluation metric at the steps it was measured, and the train/rollout
  mismatch per step (gap, importance-ratio quantiles, what the correction cut, staleness).
"""

from __future__ import annotations

import json
import logging
import os
import re
import textwrap
from pathlib import Path
from typing import Optional

log = logging.getLogger("homegym")

EVAL_COLUMNS = (  # (metric suffix, column title, format)
    ("success_rate", "success", "{:.1%}"),
    ("raw_reward", "mean reward", "{:+.3f}"),
    ("mean_turns", "mean turns", "{:.2f}"),
    ("format_error_rate", "format errors", "{:.1%}"),
)
PASSES = (  # (metric prefix, label)
    ("eval", "sampled"), ("eval_greedy", "greedy"),
    ("train_eval", "train split, sampled"), ("train_eval_greedy", "train split, greedy"),
)
TERMINAL_WIDTH = 100


def _passes(evals: dict[str, dict[str, float]]) -> list[tuple[str, str]]:
    train = any("train_eval/success_rate" in m for m in evals.values())
    return [p for p in PASSES if train or not p[0].startswith("train_")]


def format_eval_table(evals: dict[str, dict[str, float]]) -> str:
    """Markdown table: one row per evaluation, sampled and greedy columns."""
    passes = _passes(evals)
    header = ["model"]
    for prefix, label in passes:
        header += [f"{title} ({label})" for _, title, _ in EVAL_COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, m in evals.items():
        cells = [name]
        for prefix, _ in passes:
            for key, _, fmt in EVAL_COLUMNS:
                value = m.get(f"{prefix}/{key}")
                cells.append(fmt.format(value) if value is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# Columns of the terminal table, most important first: success of every pass, then the
# held-out sampled pass's other metrics, then the rest. (prefix, metric, title)
_TERMINAL_COLUMNS = (
    ("eval", "success_rate", "success"), ("eval_greedy", "success_rate", "greedy"),
    ("train_eval", "success_rate", "train success"),
    ("train_eval_greedy", "success_rate", "train greedy"),
    ("eval", "raw_reward", "reward"), ("eval", "mean_turns", "turns"),
    ("eval", "format_error_rate", "format err"),
    ("eval_greedy", "raw_reward", "greedy reward"),
)
_FORMATS = {key: fmt for key, _, fmt in EVAL_COLUMNS}


def _render(rows: list[list[str]], widths: list[int]) -> list[str]:
    def cell(text: str, w: int, left: bool) -> str:
        # The end of a long name is kept: it holds the step (run/step_000024).
        text = text if len(text) <= w else "~" + text[len(text) - w + 1:]
        return text.ljust(w) if left else text.rjust(w)

    out = []
    for i, row in enumerate(rows):
        out.append("| " + " | ".join(cell(t, w, j == 0) for j, (t, w) in
                                     enumerate(zip(row, widths))) + " |")
        if i == 0:
            out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return out


def terminal_eval_table(evals: dict[str, dict[str, float]], width: int = TERMINAL_WIDTH) -> str:
    """The evaluations in at most ``width`` columns: long model names are shortened, then
    the least important columns dropped (eval_table.md keeps them all)."""
    columns = [c for c in _TERMINAL_COLUMNS
               if any(f"{c[0]}/{c[1]}" in m for m in evals.values())]
    table = [["model", *(title for _, _, title in columns)]]
    for name, m in evals.items():
        cells = [name]
        for prefix, key, _ in columns:
            value = m.get(f"{prefix}/{key}")
            cells.append(_FORMATS[key].format(value) if value is not None else "-")
        table.append(cells)
    widths = [max(len(row[j]) for row in table) for j in range(len(table[0]))]
    widths[0] = min(widths[0], 32)
    while 4 + sum(widths) + 3 * (len(widths) - 1) > width:
        excess = 4 + sum(widths) + 3 * (len(widths) - 1) - width
        if widths[0] > 16:
            widths[0] = max(16, widths[0] - excess)
        elif len(widths) > 2:
            widths.pop()
            table = [row[:-1] for row in table]
        else:
            break
    lines = _render(table, widths)
    shown = {title for _, _, title in columns[:len(widths) - 1]}
    notes = ["success: sampled, held-out prompts", "greedy: temperature 0"]
    if "train success" in shown:
        notes.append("train: the training prompts")
    return "\n".join(lines + [textwrap.fill("; ".join(notes), width)])


# ----------------------------------------------------------------------- the plot
_EVAL_KEY = re.compile(r"^(?P<name>[^/]+)/(?P<prefix>eval|eval_greedy|train_eval|train_eval_greedy)"
                       r"/(?P<metric>success_rate|raw_reward|mean_turns|format_error_rate)$")
_PASS_STYLE = {"eval": ("held-out, sampled", "C0", "-"), "eval_greedy": ("held-out, greedy", "C0", "--"),
               "train_eval": ("train, sampled", "C1", "-"),
               "train_eval_greedy": ("train, greedy", "C1", "--")}
BEFORE_WARMUP = "initial"  # the evaluation the driver runs before a warm-up


def _read_metrics(path: Path) -> list[dict]:
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
            rows.append(row)
    return rows


# The train/rollout mismatch panels: (title, [(metric, label)], y scale, as percentages).
MISMATCH_PANELS = (
    ("train/rollout gap", [("mismatch/logprob_abs_diff", "mean |logp diff|"),
                           ("mismatch/logprob_abs_diff_max", "max |logp diff|"),
                           ("mismatch/k3_kl", "k3 KL")], "symlog", False),
    ("importance ratio pi_train / pi_rollout",
     [(f"mismatch/{level}_ratio_{q}", f"{level} {q}") for level in ("token", "seq")
      for q in ("p1", "p50", "p99")], "log", False),
    ("cut by the rollout correction",
     [(f"mismatch/{level}_{what}_frac", f"{level}s {what}") for level in ("token", "seq")
      for what in ("masked", "clipped")], "linear", True),
    ("staleness (policy versions)", [("mismatch/staleness_mean", "mean"),
                                     ("mismatch/staleness_max", "max")], "linear", False),
)


def _mismatch_panels(series: dict[str, dict[int, float]]) -> list[tuple]:
    """The mismatch panels that have data; staleness only when some batch was stale."""
    out = []
    for title, lines, scale, percent in MISMATCH_PANELS:
        lines = [(key, label) for key, label in lines if key in series]
        if not lines or (title.startswith("staleness")
                         and not any(series.get("mismatch/staleness_max", {}).values())):
            continue
        out.append((title, lines, scale, percent))
    return out


def plot_curves(run_dir: Path, out: Optional[Path] = None) -> Optional[Path]:
    """Write ``<run_dir>/curves.png`` from ``metrics.jsonl``; returns its path, or None when
    there is nothing to plot yet. A resumed run's repeated steps use their latest value."""
    # The figure is drawn on its own Agg canvas: no pyplot, so no global backend and no
    # state shared with a notebook or another run in this process.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    rows = _read_metrics(run_dir / "metrics.jsonl")
    train: dict[str, dict[int, float]] = {}
    evals: dict[tuple[str, str], dict[str, tuple[int, float]]] = {}  # (metric, prefix) -> name
    for row in rows:
        step = int(row["step"])
        for key, value in row.items():
            if key in ("rollout/raw_reward", "rollout/success_rate") or key.startswith("mismatch/"):
                train.setdefault(key, {})[step] = value
            elif (m := _EVAL_KEY.match(key)) is not None:
                evals.setdefault((m["metric"], m["prefix"]), {})[m["name"]] = (step, value)
    panels = [(key, title) for key, title in (("rollout/raw_reward", "rollout reward"),
                                              ("rollout/success_rate", "rollout success"))
              if key in train]
    panels += [(metric, f"eval {title}") for metric, title, _ in EVAL_COLUMNS
               if any(k[0] == metric for k in evals)]
    mismatch = _mismatch_panels(train)
    if not panels:
        return None
    count = len(panels) + len(mismatch)
    ncols = 3 if count > 4 else 2 if count > 1 else 1
    nrows = -(-count // ncols)
    fig = Figure(figsize=(5.2 * ncols, 3.4 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(run_dir.name)
    legend = True  # on the first evaluation panel only: every one uses the same styles
    for i, (key, title) in enumerate(panels):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if key in train:
            steps = sorted(train[key])
            ax.plot(steps, [train[key][s] for s in steps], color="C2", marker=".")
        else:
            before = False
            for prefix, (label, color, style) in _PASS_STYLE.items():
                points = evals.get((key, prefix))
                if not points:
                    continue
                line = sorted((s, v) for name, (s, v) in points.items() if name != BEFORE_WARMUP)
                if line:
                    ax.plot([s for s, _ in line], [v for _, v in line], color=color,
                            linestyle=style, marker="o", label=label)
                if BEFORE_WARMUP in points:
                    s, v = points[BEFORE_WARMUP]
                    ax.plot([s], [v], color=color, marker="x", linestyle="none",
                            label="before warm-up" if not before else None)
                    before = True
            if legend:
                ax.legend(fontsize="small")
                legend = False
        if key.endswith(("success_rate", "format_error_rate")):
            ax.set_ylim(-0.03, 1.03)
            ax.yaxis.set_major_formatter("{x:.0%}")
    for i, (title, lines, scale, percent) in enumerate(mismatch, start=len(panels)):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        for j, (key, label) in enumerate(lines):
            steps = sorted(train[key])
            ax.plot(steps, [train[key][s] for s in steps], color=f"C{j}", marker=".", label=label)
        # symlog: a gap of exactly 0 (fp32 engines and trainer) stays on the plot.
        ax.set_yscale(scale, **({"linthresh": 1e-6} if scale == "symlog" else {}))
        if percent:
            ax.yaxis.set_major_formatter("{x:.0%}")
        ax.legend(fontsize="small")
    out = Path(out) if out is not None else run_dir / "curves.png"
    tmp = out.with_name(out.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, out)  # a viewer never sees half a file
    return out


class CurvesWriter:
    """``plot_curves`` for the driver: a plot that fails is logged, never fails the run, and
    a plot of the same metrics.jsonl is not drawn twice (each drawing takes about a second
    of CPU; the end of a run would otherwise redraw what its last evaluation drew)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self._drawn_from: Optional[tuple[int, int]] = None  # metrics.jsonl's (size, mtime)

    def write(self) -> Optional[Path]:
        try:
            st = (self.run_dir / "metrics.jsonl").stat()
            source = (st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            source = None
        if source is not None and source == self._drawn_from:
            return self.run_dir / "curves.png"
        try:
            out = plot_curves(self.run_dir)
        except Exception as err:
            log.warning("curves.png not written: %s: %s", type(err).__name__, err)
            return None
        if out is not None:  # nothing drawn yet (no panel): the next call tries again
            self._drawn_from = source
        return out
