"""Named breakages of homegym, each applied once, and whether the suite catches it.

    python scripts/mutants.py                 # every breakage
    python scripts/mutants.py --list
    python scripts/mutants.py skip-norm tp-entropy-grad

Each breakage is one text replacement in one source file. It is applied to a temporary
copy of the working tree (tracked and untracked files, never the checkout itself), the
tests that claim to catch it run there (pytest, PYTHONPATH at the copy), and the report
says caught (the tests failed) or MISSED (they passed). Before the first breakage the
same tests run once unbroken in their copy and must pass, so a "caught" is the breakage's
doing. Tests that start Ray, engines or training ranks run under the shared slot lock
(/work/bin/heavy, when present). docs/testing.md lists the breakages and their tests.
Not part of CI: one breakage costs one run of its tests.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = "/work/bin/heavy"


@dataclass(frozen=True)
class Breakage:
    name: str
    what: str  # the breakage in words (docs/testing.md quotes it)
    path: str  # file, relative to the repository
    old: str  # exact text, found exactly once
    new: str
    tests: tuple[str, ...]  # pytest node ids that must fail


BREAKAGES = [
    Breakage(
        "engine-ack-no-load",
        "an engine that acknowledges a weight push (and reports its version) without "
        "loading the tensors",
        "rollout/engines/hf/server.py",
        "            for name, tensor in named:\n                sd[name].copy_(tensor)",
        "            for name, tensor in named:\n                pass",
        ("tests/test_loop.py::test_weight_sync_round_trip",
         "tests/test_engine_updates.py::test_no_request_after_a_push_uses_kv_of_the_old_weights")),
    Breakage(
        "loss-mask-shift",
        "the loss mask shifted by one token (each sample's mask starts one token late)",
        "trainer/training/backends/batching.py",
        "loss_mask = torch.tensor([m for i in sample_ids for m in batch.loss_masks[i]],",
        "loss_mask = torch.tensor([m for i in sample_ids\n"
        "                              for m in [0] + batch.loss_masks[i][:-1]],",
        ("tests/test_fsdp_batching.py::test_micro_batch_indices_point_at_response_tokens",
         "tests/test_backend_parity.py::test_fsdp_and_megatron_steps_equal_plain_autograd")),
    Breakage(
        "ledger-requeues-trained",
        "the prompt ledger re-queues a group it just marked trained",
        "rollout/ledger.py",
        "            self.trained[key] += 1\n",
        "            self.trained[key] += 1\n            self.requeued.append(key)\n",
        ("tests/test_rollout_ledger.py",)),
    Breakage(
        "resume-skips-optimizer",
        "a resume that loads the weights but not the optimizer state (Adam moments, step)",
        "trainer/training/backends/fsdp.py",
        'state = {"model": self._model_state(model_sd), "optim": optim_sd}\n'
        '        dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))',
        'state = {"model": self._model_state(model_sd)}\n'
        '        dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))\n'
        '        state["optim"] = optim_sd',
        ("tests/test_fsdp_train_group.py::test_save_load_restores_params_and_optimizer",)),
    Breakage(
        "resume-restarts-data",
        "a resume that restores the rollout manager's ledger and buffer but not the data "
        "source's position (the data order starts over)",
        "rollout/manager.py",
        '        self.train_data.load_state_dict(state["train_data"])\n',
        "",
        ("tests/test_rollout_ledger.py::"
         "test_manager_trains_every_group_once_through_failures_extras_and_a_checkpoint",)),
    Breakage(
        "dedupe-wrong-row",
        "a sample that repeats another reads its logits from the micro-batch's first row, "
        "not from the row of the sample it repeats",
        "trainer/training/backends/batching.py",
        "            distinct.append(i)\n        source.append(first[key])",
        "            distinct.append(i)\n            source.append(first[key])\n"
        "        else:\n            source.append(0)",
        ("tests/test_fsdp_batching.py::test_identical_samples_share_a_row_and_keep_their_own_"
         "loss_fields",
         "tests/test_fsdp_train_group.py::test_identical_samples_run_once_without_changing_"
         "the_update")),
    Breakage(
        "skip-norm",
        "skipped zero-advantage samples no longer count in the loss denominators "
        "(the update of a step with skipped groups is scaled up)",
        "trainer/training/backends/batching.py",
        "return LossNorms(num_tokens=sum(sum(batch.loss_masks[i]) for i in sample_range),\n"
        "                     num_seqs=len(sample_range),",
        "return LossNorms(num_tokens=sum(sum(batch.loss_masks[i]) for i in ran),\n"
        "                     num_seqs=len(ran),",
        ("tests/test_fsdp_train_group.py::"
         "test_zero_advantage_samples_are_skipped_without_changing_the_update",)),
    Breakage(
        "tp-entropy-grad",
        "tensor-parallel entropy written with p = e / sum(e) (the TP all-reduce's identity "
        "backward then drops the other rank's share of the entropy gradient)",
        "trainer/training/backends/megatron/model.py",
        "entropy = lse - reduce((exp * shifted).sum(dim=-1)) / sum_exp",
        "entropy = lse - reduce((exp / sum_exp[:, None] * shifted).sum(dim=-1))",
        ("tests/test_megatron_backend.py::test_model_parallel_equals_single_rank[tp2]",)),
    Breakage(
        "staleness-off-by-one",
        "async generation runs one step further ahead than algo.max_staleness allows",
        "trainer/driver/pipeline.py",
        # Both bounds (queue length and version) move: either alone is implied by the other.
        "len(self._queue) <= self.max_staleness\n"
        "               and version >= self._next - 1 - self.max_staleness):",
        "len(self._queue) <= self.max_staleness + 1\n"
        "               and version >= self._next - 2 - self.max_staleness):",
        ("tests/test_async_pipeline.py::test_generation_runs_ahead_by_the_staleness_bound",)),
    Breakage(
        "agent-retokenizes",
        "an agent session that re-renders an answered assistant message from its parsed "
        "tool calls instead of the model's own text (the next call no longer extends the "
        "recorded tokens)",
        "rollout/agent/session.py",
        "        if answer is not None and answer.echoed_by(message):",
        "        if False and answer is not None and answer.echoed_by(message):",
        ("tests/test_rollout_agent.py::"
         "test_every_dialect_records_the_same_token_exact_sample_malformed_call_included",)),
    Breakage(
        "restart-without-policy",
        "a restarted engine rejoins the router without being given the current policy "
        "(it serves the base weights)",
        "rollout/engines/group.py",
        "            if dead and push_weights is not None:",
        "            if False and dead and push_weights is not None:",
        ("tests/test_faults_engine.py::"
         "test_engine_dies_mid_rollout_step_completes_and_engine_recovers",)),
    Breakage(
        "lora-merge-unscaled",
        "the LoRA push merges B @ A into the base weight without the alpha / r scaling",
        "trainer/training/backends/lora.py",
        "merged.addmm_(b.float(), a.float(), alpha=layers[module])",
        "merged.addmm_(b.float(), a.float(), alpha=1.0)",
        ("tests/test_lora.py::test_merged_export_is_peft_merge_of_the_saved_adapter",)),
    Breakage(
        "prefix-cache-hole",
        "the CPU engine's prefix cache stores a finished row's KV one column off where a "
        "padding hole lies between its cached past and its new tokens",
        "rollout/engines/hf/batcher.py",
        "            end = width - fed - r.kv_hole\n",
        "            end = width - fed - r.kv_hole + 1\n",
        ("tests/test_engine_hf.py::"
         "test_prefix_cache_keeps_the_kv_of_rows_prefilled_over_a_past",)),
]


def copy_tree(dest: Path) -> None:
    """The working tree's tracked and untracked (not ignored) files, as they are now."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, check=True, capture_output=True).stdout.split(b"\0")
    for name in filter(None, files):
        src = REPO / name.decode()
        if src.is_file():
            out = dest / name.decode()
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, out)


def apply(tree: Path, b: Breakage) -> None:
    path = tree / b.path
    text = path.read_text()
    if text.count(b.old) != 1:
        raise SystemExit(f"{b.name}: the text to replace occurs {text.count(b.old)} times "
                         f"in {b.path} (the code moved: update the breakage)")
    path.write_text(text.replace(b.old, b.new))


def run_tests(tree: Path, tests: tuple[str, ...], timeout_s: float,
              lock: bool = True) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    if lock and os.path.exists(HEAVY):
        cmd = [HEAVY, *cmd]
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.setdefault("HOMEGYM_CACHE", str(REPO / ".cache" / "homegym"))
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
        return proc.returncode, proc.stdout[-20000:] + proc.stderr[-5000:], time.monotonic() - start
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {timeout_s:.0f}s", time.monotonic() - start


LOG_DIR = Path(tempfile.gettempdir()) / "hg-mutants"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="breakages to apply (default: all)")
    parser.add_argument("--list", action="store_true", help="list the breakages and exit")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the unbroken run of each breakage's tests")
    parser.add_argument("--timeout", type=float, default=3600, help="per pytest run, seconds")
    parser.add_argument("--no-lock", action="store_true",
                        help="do not take a heavy slot per run (the caller holds one)")
    args = parser.parse_args()
    chosen = [b for b in BREAKAGES if not args.names or b.name in args.names]
    unknown = set(args.names) - {b.name for b in BREAKAGES}
    if unknown:
        parser.error(f"unknown breakages {sorted(unknown)}")
    if args.list:
        for b in chosen:
            print(f"{b.name}: {b.what}\n    {b.path}; caught by {', '.join(b.tests)}")
        return 0
    rows = []
    for b in chosen:
        with tempfile.TemporaryDirectory(prefix=f"hg-mutant-{b.name}-") as tmp:
            tree = Path(tmp)
            copy_tree(tree)
            if not args.no_baseline:
                code, out, secs = run_tests(tree, b.tests, args.timeout, not args.no_lock)
                if code != 0:
                    print(f"{b.name}: its tests fail WITHOUT the breakage ({secs:.0f}s):\n{out}")
                    rows.append((b.name, "baseline fails", secs))
                    continue
            apply(tree, b)
            code, out, secs = run_tests(tree, b.tests, args.timeout, not args.no_lock)
            LOG_DIR.mkdir(exist_ok=True)
            (LOG_DIR / f"{b.name}.log").write_text(out)
            verdict = "caught" if code not in (0, -1) else ("timeout" if code == -1 else "MISSED")
            print(f"{b.name}: {verdict} ({secs:.0f}s)", flush=True)
            if verdict != "caught":
                print(out)
            else:  # the failing assertion, for the record
                print("\n".join(line for line in out.splitlines()
                                if line.startswith(("E ", "FAILED", "ERROR")))[:1500])
            rows.append((b.name, verdict, secs))
    print("\nbreakage                 result    seconds")
    for name, verdict, secs in rows:
        print(f"{name:<24} {verdict:<9} {secs:7.0f}")
    return 0 if all(v == "caught" for _, v, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
