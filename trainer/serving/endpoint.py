"""``Endpoint``: engines + router + the authenticating proxy for one model or checkpoint,
and its OpenAI-compatible client (``chat`` / ``chat_completion``).

The engines are the same ones training uses (hf on CPU, SGLang on GPU), behind the real
sglang-router; only the proxy (trainer.serving.auth_proxy) listens on the public host.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional, Sequence

import requests

from trainer.serving.auth_proxy import AuthProxy, choose_api_key
from trainer.driver.checkpoint import resolve_checkpoint


class EndpointError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message



def _model_overrides(model: Any, checkpoint: Any) -> tuple[list[str], dict]:
    """Hydra overrides + values for the model (an api.Model, a path string or None) and an
    optional checkpoint (which replaces the weights, keeping the family's settings)."""
    overrides: list[str] = []
    values: dict = {}
    if model is not None and hasattr(model, "overrides"):
        overrides += model.overrides()
        values = model.values()
    elif isinstance(model, (str, os.PathLike)):
        values = {"model": {"path": str(model)}}
    if checkpoint is not None:
        values = {"model": {"path": resolve_checkpoint(checkpoint)}}
    return overrides, values



class Endpoint:
    """An OpenAI-compatible endpoint for a model or checkpoint (engines + router + proxy).

    ``Endpoint.launch(model, checkpoint=None, unauthenticated=False)``; ``chat(messages,
    chat_template_kwargs=...)`` returns the assistant message dict; ``url``; ``api_key``
    (None when unauthenticated); ``wait_until_ready(timeout)``; ``shutdown()``; a context
    manager."""

    def __init__(self, config, engines, proxy: AuthProxy, api_key: Optional[str],
                 started_ray: bool, model_name: str) -> None:
        self.config = config
        self._engines = engines
        self._proxy = proxy
        self._api_key = api_key
        self._started_ray = started_ray
        self.model_name = model_name
        host = proxy.host if proxy.host not in ("0.0.0.0", "::") else "127.0.0.1"
        self.url = f"http://{host}:{proxy.port}"
        self._session = requests.Session()
        self.default_max_tokens = config.rollout.max_response_len

    @property
    def api_key(self) -> Optional[str]:
        return self._api_key

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}

    @classmethod
    def launch(cls, model: Any = None, checkpoint: Any = None, *, unauthenticated: bool = False,
               api_key: Optional[str] = None, host: str = "127.0.0.1", port: int = 0,
               num_engines: Optional[int] = None, recipe: Any = None,
               overrides: Sequence[str] = (), recreate_if_existing: bool = True,
               quiet: bool = False, own_ray: bool = False) -> "Endpoint":
        """Start engines for ``model`` (an api.Model, a path, or None = the config's model),
        optionally with ``checkpoint``'s weights, and the authenticating entry on host:port.
        ``recreate_if_existing`` is accepted for seed compatibility: every launch starts
        fresh processes. ``recipe`` (an api.Recipe) picks the engine settings (GPU recipes
        use SGLang). Ray: the current cluster, else a local one that stays up for the rest
        of the process (so training and further endpoints reuse it) unless ``own_ray``."""
        from rollout.agent.serving import ChatService
        from rollout.chat import load_tokenizer
        from config import compose_config
        from trainer.driver import components
        from trainer.driver.runtime import connect_ray

        hydra_overrides, values = _model_overrides(model, checkpoint)
        if recipe is not None:
            hydra_overrides = recipe.hydra_overrides() + hydra_overrides
        hydra_overrides += list(overrides)
        if num_engines is not None:
            values.setdefault("rollout", {})["num_engines"] = int(num_engines)
        config = compose_config(hydra_overrides, values)

        key = choose_api_key(unauthenticated, api_key)
        started_ray = connect_ray(config) and own_ray
        engines = components.engine_group(config)
        model_name = str(checkpoint) if checkpoint is not None else config.model.path
        chat = ChatService(engines.router_url, load_tokenizer(engines.model_path),
                           config.model.max_context_len)
        proxy = AuthProxy(engines.router_url, key, host, port, model_name, chat)
        try:
            proxy.start()
        except BaseException:
            engines.shutdown()
            raise
        ep = cls(config, engines, proxy, key, started_ray, model_name)
        if not quiet:
            print(f"homegym: serving {model_name} at {ep.url}/v1/chat/completions "
                  f"({'no API key' if key is None else 'API key required'})", flush=True)
        return ep

    def wait_until_ready(self, timeout: float = 900.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self._session.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"endpoint {self.url} not ready after {timeout:.0f}s")
            time.sleep(0.2)

    def chat_completion(self, messages: list[dict], *, chat_template_kwargs: Optional[dict] = None,
                        max_tokens: Optional[int] = None, timeout: float = 600.0,
                        **params: Any) -> dict:
        """The full OpenAI response object."""
        body: dict[str, Any] = {"model": self.model_name, "messages": messages,
                                "max_tokens": max_tokens or self.default_max_tokens}
        if chat_template_kwargs:
            body["chat_template_kwargs"] = dict(chat_template_kwargs)
        body.update({k: v for k, v in params.items() if v is not None})
        r = self._session.post(self.url + "/v1/chat/completions", json=body,
                               headers=self.headers, timeout=timeout)
        if r.status_code != 200:
            try:
                err = r.json().get("error")
                message = err.get("message") if isinstance(err, dict) else (err or r.text)
            except ValueError:
                message = r.text
            raise EndpointError(r.status_code, str(message))
        return r.json()

    def chat(self, messages: list[dict], chat_template_kwargs: Optional[dict] = None,
             **params: Any) -> dict:
        """The assistant message ``{"role": "assistant", "content": ...}`` (seed contract)."""
        out = self.chat_completion(messages, chat_template_kwargs=chat_template_kwargs, **params)
        return dict(out["choices"][0]["message"])

    def shutdown(self) -> None:
        import ray

        proxy, self._proxy = self._proxy, None
        if proxy is not None:
            proxy.stop()
        engines, self._engines = self._engines, None
        if engines is not None:
            engines.shutdown()
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> "Endpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:  # never shows the key
        return f"Endpoint(url={self.url!r}, model={self.model_name!r}, " \
               f"auth={'on' if self._api_key else 'off'})"
