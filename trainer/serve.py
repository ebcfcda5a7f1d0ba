"""Serve a model or a checkpoint with an OpenAI-compatible ``/v1/chat/completions``
(streamed too), OpenAI's ``/v1/responses`` and Anthropic's ``/v1/messages``.

    python -m trainer.serve checkpoint=outputs/<run>/checkpoints/latest
    python -m trainer.serve model.path=/models/Qwen3-4B +recipe=qwen_4b port=8000 host=0.0.0.0
    python -m trainer.serve checkpoint=... unauthenticated=true     # no API key (trusted nets)

Extra keys: ``checkpoint`` (a checkpoint dir with ``hf/``, an ``hf/`` dir, or a run dir:
its latest checkpoint), ``host`` (default 127.0.0.1), ``port`` (default 8000; 0 = free
port), ``unauthenticated`` (default false). Everything else is a Hydra override of the
training config (``rollout.num_engines=1``, ``+recipe=...``): the engines are the same ones
training uses (hf on CPU, SGLang on GPU), behind the real sglang-router.

Authentication: every route but ``GET /health`` needs ``Authorization: Bearer <key>`` (or
``x-api-key: <key>``, as the anthropic client sends it); the key is ``$HOMEGYM_API_KEY``,
else one is generated and printed once. Only the authenticating proxy
(trainer/serving/auth_proxy.py) listens on ``host``; the engines and the router stay on
``cluster.host`` (loopback by default).
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Optional, Sequence

from config import ConfigError, split_args
from trainer.serving.endpoint import Endpoint

_TRUE = ("1", "true", "yes", "on")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    own, overrides = split_args(argv, ("checkpoint", "host", "port", "unauthenticated"))
    try:
        ep = Endpoint.launch(None, own.get("checkpoint"),
                             unauthenticated=own.get("unauthenticated", "false").lower() in _TRUE,
                             host=own.get("host", "127.0.0.1"), port=int(own.get("port", 8000)),
                             overrides=overrides, own_ray=True)
    except (ConfigError, FileNotFoundError) as err:
        print(f"homegym: invalid config: {err}", file=sys.stderr)
        return 2
    auth = '-H "Authorization: Bearer $HOMEGYM_API_KEY" ' if ep.api_key else ""
    print(f"homegym: try: curl {ep.url}/v1/chat/completions {auth}-H 'Content-Type: "
          "application/json' -d '{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}'",
          flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    finally:
        print("homegym: shutting down the endpoint", flush=True)
        ep.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
