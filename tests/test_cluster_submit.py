"""`scripts/submit.py` against a real on-prem-style cluster: `ray start --head` with its
dashboard (job server) on this machine, a tiny homegym run submitted as a Ray job with a
runtime_env (working dir upload, env vars passed through). The job must succeed, its run
directory must hold the step's metrics and a checkpoint, and the passed-through secret must
appear neither in submit.py's output nor in the job's logs.

The head runs with `--block` as our child in its own session, so the test stops exactly the
processes it started (never `ray stop`, which stops every Ray instance on the machine).
"""

import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import requests

from conftest import REPO, clean_env, free_port, run_group

pytestmark = pytest.mark.slow
# Ray 2.60 turns token authentication on by default; a throw-away loopback cluster runs
# without it (the README shows the token set-up for a real cluster).
NO_TOKEN = {"RAY_AUTH_MODE": "disabled"}


@pytest.fixture()
def ray_head(tmp_path):
    ray_bin = Path(sys.executable).parent / "ray"
    gcs, dash, agent = free_port(), free_port(), free_port()
    temp = Path("/tmp") / f"hgray-{uuid.uuid4().hex[:6]}"  # short: unix socket path limit
    env = dict(clean_env(), RAY_USAGE_STATS_ENABLED="0", **NO_TOKEN)
    log = open(tmp_path / "ray_head.log", "wb")
    head = subprocess.Popen(
        [str(ray_bin), "start", "--head", "--block", "--port", str(gcs),
         "--node-ip-address", "127.0.0.1", "--include-dashboard", "true",
         "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash), "--num-cpus", "6",
         # The job agent's HTTP port defaults to 52365, which another Ray on the machine
         # may hold (then jobs fail with "No available agent").
         "--dashboard-agent-listen-port", str(agent),
         "--temp-dir", str(temp), "--disable-usage-stats"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{dash}"
    tree = {}
    try:
        deadline = time.time() + 180
        while True:
            assert head.poll() is None, (tmp_path / "ray_head.log").read_text()[-3000:]
            try:
                if requests.get(url + "/api/version", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.time() < deadline, "dashboard not up in 180s"
            time.sleep(1)
        yield url
    finally:
        try:
            tree = {p.pid: p for p in psutil.Process(head.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
        head.send_signal(signal.SIGTERM)  # --block: stops the processes it started
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        gone, alive = psutil.wait_procs(list(tree.values()), timeout=20)
        for p in alive:  # only processes of this head
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        log.close()


def test_submit_runs_a_tiny_job_on_a_ray_start_cluster(ray_head, tmp_path, monkeypatch):
    out = tmp_path / "jobout"
    secret = f"hg-wandb-{uuid.uuid4().hex}"
    env = dict(clean_env(), WANDB_API_KEY=secret, **NO_TOKEN)
    cmd = [sys.executable, "scripts/submit.py", "--address", ray_head,
           "--python", sys.executable, "--",
           "train.num_steps=1", "warmup.steps=2", "rollout.num_engines=1",
           "train.ranks_per_node=1", "rollout.rollout_batch_size=2",
           "rollout.n_samples_per_prompt=2", "eval.before_and_after=false",
           "logging.wandb_mode=disabled", f"logging.output_dir={out}", "logging.run_name=job"]
    proc = run_group(cmd, cwd=REPO, timeout_s=600, env=env)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-5000:]
    assert "SUCCEEDED" in text
    assert "Connecting to existing Ray cluster" in text  # it joined the cluster, no local Ray
    assert secret not in text  # neither submit.py nor the job's log shows the value
    assert "WANDB_API_KEY" in text  # ... only its name
    run = out / "job"
    assert (run / "checkpoints" / "latest" / "COMPLETE").exists()
    assert "train/pg_loss" in (run / "metrics.jsonl").read_text()
    # Ray does hold the value for the job's processes (passed through, not dropped).
    from ray.job_submission import JobSubmissionClient

    for key, value in NO_TOKEN.items():  # for this test only, not the session
        monkeypatch.setenv(key, value)
    jobs = JobSubmissionClient(ray_head).list_jobs()
    assert any((j.runtime_env or {}).get("env_vars", {}).get("WANDB_API_KEY") == secret
               for j in jobs)
