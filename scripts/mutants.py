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
        return proc.returncode, proc.stdout[-3000:] + proc.stderr[-2000:], time.monotonic() - start
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {timeout_s:.0f}s", time.monotonic() - start


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
            verdict = "caught" if code not in (0, -1) else ("timeout" if code == -1 else "MISSED")
            print(f"{b.name}: {verdict} ({secs:.0f}s)", flush=True)
            if verdict != "caught":
                print(out)
            else:  # the failing assertion, for the record
                print("\n".join(l for l in out.splitlines() if l.startswith(("E ", "FAILED")))[:1500])
            rows.append((b.name, verdict, secs))
    print("\nbreakage                 result    seconds")
    for name, verdict, secs in rows:
        print(f"{name:<24} {verdict:<9} {secs:7.0f}")
    return 0 if all(v == "caught" for _, v, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
