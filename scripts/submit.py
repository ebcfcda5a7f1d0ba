"""Submit a homegym run to an on-prem Ray cluster as a Ray job.

    python scripts/submit.py --address http://HEAD:8265 -- +recipe=qwen_4b model.path=/models/Qwen3-4B
    python scripts/submit.py --address http://HEAD:8265 --pip-extra gpu --env WANDB_API_KEY -- +recipe=qwen_8b

Everything after `--` is passed to `python -m trainer.main`. The job's runtime_env ships
this working directory (minus caches, outputs and the venv), installs homegym with the
requested extras on the workers if asked, and passes the named environment variables
through from this shell. Their values are sent to Ray only; this script never prints them.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Paths that never belong in a job's working_dir upload.
EXCLUDES = [".venv", ".cache", "outputs", "wandb", ".git", "**/__pycache__", "*.egg-info",
            ".pytest_cache"]
# Forwarded by default when set: credentials and the knobs that steer logging.
DEFAULT_ENV = ["WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_ENTITY", "HF_HOME", "HOMEGYM_CACHE"]


def build_runtime_env(*, pip_extras: list[str], env_names: list[str],
                      working_dir: Path = REPO) -> dict:
    env_vars = {name: os.environ[name] for name in dict.fromkeys(DEFAULT_ENV + env_names)
                if name in os.environ}
    env_vars.setdefault("OMP_NUM_THREADS", "1")
    runtime_env: dict = {"working_dir": str(working_dir), "excludes": EXCLUDES,
                         "env_vars": env_vars}
    if pip_extras:
        # Installs homegym itself (from the uploaded working dir) with the extras on workers.
        runtime_env["pip"] = [f".[{','.join(pip_extras)}]"]
    return runtime_env


def describe(runtime_env: dict) -> dict:
    """What is safe to print: env var names only, never values."""
    shown = dict(runtime_env)
    shown["env_vars"] = sorted(runtime_env.get("env_vars", {}))
    return shown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "http://127.0.0.1:8265"),
                        help="Ray dashboard address of the head node (default: $RAY_ADDRESS)")
    parser.add_argument("--pip-extra", action="append", default=[],
                        help="homegym extras to pip-install on the workers (e.g. gpu)")
    parser.add_argument("--env", action="append", default=[],
                        help="environment variable to pass through (value taken from this shell)")
    parser.add_argument("--python", default="python",
                        help="interpreter the job's entrypoint runs with on the head node "
                             "(default: `python` on the PATH of the node's `ray start`)")
    parser.add_argument("--no-wait", action="store_true", help="return after submitting")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for trainer.main")
    args = parser.parse_args(argv)

    from ray.job_submission import JobStatus, JobSubmissionClient

    runtime_env = build_runtime_env(pip_extras=args.pip_extra, env_names=args.env)
    entrypoint = (f"{shlex.quote(args.python)} -m trainer.main "
                  + " ".join(shlex.quote(o) for o in args.overrides))
    client = JobSubmissionClient(args.address)
    job_id = _submit(client, entrypoint, runtime_env)
    print(f"submitted {job_id}: {entrypoint}\nruntime_env: {describe(runtime_env)}")
    if args.no_wait:
        return 0
    for line in _tail(client, job_id):
        print(line, end="")
    status = client.get_job_status(job_id)
    print(f"\njob {job_id}: {status}")
    return 0 if status == JobStatus.SUCCEEDED else 1


def _submit(client, entrypoint: str, runtime_env: dict, wait_s: float = 120.0) -> str:
    """Submit, retrying while a freshly started head has no job agent yet."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        try:
            return client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env)
        except RuntimeError as err:
            if "no available agent" not in str(err).lower() or time.monotonic() > deadline:
                raise
            time.sleep(2)


def _tail(client, job_id):
    import asyncio

    async def collect():
        async for chunk in client.tail_job_logs(job_id):
            yield chunk

    agen = collect()
    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                yield loop.run_until_complete(agen.__anext__())
            except StopAsyncIteration:
                return
    finally:
        loop.close()


if __name__ == "__main__":
    sys.exit(main())
