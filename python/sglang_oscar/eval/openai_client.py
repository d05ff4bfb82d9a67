"""A minimal client for OpenAI-compatible servers (SGLang, vLLM, ...), standard library only.

Only what the eval drivers need: /v1/chat/completions, /v1/completions, /v1/models, and a health
wait. urllib instead of `openai`/`requests` so the drivers run on a bare install. Transient
failures (connection refused while the server restarts, 5xx, 429) are retried with backoff;
4xx errors are not (a bad request will not get better) and carry the server's message.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any, Optional

RETRY_STATUS = (429, 500, 502, 503, 504)


class ApiError(RuntimeError):
    """A request the server refused or that could not be completed after the retries."""


class OpenAIClient:
    def __init__(self, base_url: str, api_key: Optional[str] = None, timeout: float = 3600.0, retries: int = 3,
                 backoff: float = 2.0):
        # Accept http://host:port, http://host:port/ and http://host:port/v1 alike.
        base = base_url.rstrip("/")
        self.base_url = base if base.endswith("/v1") else base + "/v1"
        self.api_key = api_key
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff

    # ------------------------------------------------------------------------------ transport
    def _request(self, method: str, path: str, body: Optional[dict] = None, timeout: Optional[float] = None) -> Any:
        url = self.base_url + path
        data = None if body is None else json.dumps(body).encode("utf-8")
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last = None
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(url, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                    return json.loads(resp.read().decode("utf-8"))
            except urllib.error.HTTPError as e:
                detail = e.read().decode("utf-8", "replace")[:2000]
                last = ApiError(f"{method} {url}: HTTP {e.code}: {detail}")
                if e.code not in RETRY_STATUS:
                    raise last from None
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
                last = ApiError(f"{method} {url}: {e}")
            except ValueError as e:  # a 200 with a body that is not JSON: a proxy, not the server
                raise ApiError(f"{method} {url}: response is not JSON ({e})") from None
            if attempt < self.retries:
                time.sleep(self.backoff * (2 ** attempt))
        raise last

    # ------------------------------------------------------------------------------- endpoints
    def models(self) -> list[str]:
        return [m["id"] for m in self._request("GET", "/models", timeout=30).get("data", [])]

    def wait_ready(self, timeout: float = 600.0, interval: float = 2.0) -> list[str]:
        """Poll /v1/models until the server answers; returns the served model ids."""
        deadline = time.time() + timeout
        while True:
            try:
                saved, self.retries = self.retries, 0
                try:
                    return self.models()
                finally:
                    self.retries = saved
            except ApiError as e:
                if time.time() > deadline:
                    raise ApiError(f"server at {self.base_url} not ready after {timeout:.0f}s: {e}") from None
                time.sleep(interval)

    def chat(self, messages: list[dict], model: str, **sampling) -> dict:
        """One chat completion: dict(text, reasoning, finish_reason, prompt_tokens, completion_tokens)."""
        body = dict(model=model, messages=messages, **_clean(sampling))
        out = self._request("POST", "/chat/completions", body)
        try:
            choice = out["choices"][0]
            msg = choice["message"]
        except (KeyError, IndexError, TypeError):
            raise ApiError(f"unexpected chat response: {json.dumps(out)[:500]}") from None
        usage = out.get("usage") or {}
        # SGLang/vLLM put a parsed thinking trace in reasoning_content (reasoning_parser on).
        return dict(text=msg.get("content") or "", reasoning=msg.get("reasoning_content") or "",
                    finish_reason=choice.get("finish_reason"), prompt_tokens=usage.get("prompt_tokens"),
                    completion_tokens=usage.get("completion_tokens"))

    def complete(self, prompt, model: str, **sampling) -> dict:
        """One text completion; `prompt` is a string or a list of token ids (exact prompt length)."""
        body = dict(model=model, prompt=prompt, **_clean(sampling))
        out = self._request("POST", "/completions", body)
        try:
            choice = out["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise ApiError(f"unexpected completion response: {json.dumps(out)[:500]}") from None
        usage = out.get("usage") or {}
        return dict(text=choice.get("text") or "", reasoning="", finish_reason=choice.get("finish_reason"),
                    prompt_tokens=usage.get("prompt_tokens"), completion_tokens=usage.get("completion_tokens"))


def _clean(sampling: dict) -> dict:
    # None means "server default": do not send it (some servers reject explicit nulls).
    return {k: v for k, v in sampling.items() if v is not None}
