"""CPU seconds per process while a command runs, every process on the machine included
(Ray's daemons and actors are not the command's descendants).

    python scripts/cpu_by_process.py [--interval 0.5] [--top 15] -- COMMAND [ARGS...]

Every ``--interval`` seconds it reads utime + stime of each process from /proc and keeps
the last reading per pid (and its last non-empty command line: an exiting actor's reads
empty); at the end it prints the wall time and the CPU each command line took, processes
with the same command line summed (numbers and /tmp paths folded, so the same role from two
runs groups). The command's own process is read once more as it exits, before it is
reaped; any other process's last interval before it exits is missed, so short-lived ones
read low. To get a per-step figure, run the same benchmark at two step counts and take the
difference (docs/performance.md does this for bench_vs_trl.py's async step).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def read_all() -> dict[int, tuple[float, str]]:
    """pid -> (CPU seconds so far, command line) for every readable process."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # exited between listdir and open
            continue
        out[int(name)] = ((int(fields[11]) + int(fields[12])) / TICK, cmd)
    return out


def role(cmd: str) -> str:
    cmd = re.sub(r"/tmp/\S+", "TMP", cmd)
    return re.sub(r"\d{4,}", "N", cmd)[:150] or "(no command line)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to measure after --")
    before = read_all()
    start = time.perf_counter()
    proc = subprocess.Popen(command)
    last: dict[int, tuple[float, str]] = {}
    while True:
        # Exited but not yet reaped, the command's process still shows its final CPU (its
        # own only: wait4's figure would add its reaped children, Ray's daemons among them).
        exited = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        for pid, (cpu, cmd) in read_all().items():
            last[pid] = (cpu, cmd or last.get(pid, (0.0, ""))[1])
        if exited is not None:
            break
        time.sleep(args.interval)
    returncode = proc.wait()
    wall = time.perf_counter() - start
    by_role: dict[str, float] = collections.defaultdict(float)
    for pid, (cpu, cmd) in last.items():
        if pid in before and before[pid][1] == cmd:
            cpu -= before[pid][0]  # running before the command: count only its share
        if cpu > 0:
            by_role[role(cmd)] += cpu
    total = sum(by_role.values())
    print(f"wall {wall:.1f} s, CPU {total:.1f} s ({total / wall:.2f} cores busy) "
          f"on {os.cpu_count()} CPUs")
    for name, cpu in sorted(by_role.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{cpu:8.2f}  {name}")
    sys.exit(returncode)


if __name__ == "__main__":
    main()
