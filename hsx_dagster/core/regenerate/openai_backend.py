"""The `openai` backend: any OpenAI-compatible chat server (vLLM, SGLang, ``transformers serve``).

Every endpoint gets ``concurrency`` workers; each worker takes a whole conversation from the shared
queue and regenerates its turns one after another on its endpoint (the server's prefix cache then
holds the conversation's history). Requests are retried with exponential backoff on timeouts, 5xx
and 429; a conversation whose request still fails is recorded as failed with the reason. An endpoint
that cannot be reached (refused connection, connection dropped) after the retries is taken out of
rotation: its conversations go back to the queue for the others. When no endpoint is left the run
stops with an error naming them, after committing every conversation already finished.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from hsx_dagster.core.regenerate.run import (
    PromptRenderer,
    RegenerationError,
    Stats,
    opens_think,
    template_failure,
)
from hsx_dagster.core.regenerate.turns import ConversationJob, FailureReason, Generated, split_reasoning
from hsx_dagster.core.settings import RegenerateSettings

MAX_BACKOFF_S = 60.0
_UNREACHABLE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.PoolTimeout)


class _EndpointDown(Exception):
    """The endpoint could not be reached after the retries; the conversation goes to another one."""


class _RequestFailed(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


@dataclass
class _Endpoint:
    url: str
    model: str
    alive: bool = True
    last_error: str = ""


class _JobQueue:
    """The conversations to regenerate: those whose endpoint went down first, then the input's next ones."""

    def __init__(self, jobs: Iterator[ConversationJob]) -> None:
        self.jobs = jobs
        self.requeued: deque[ConversationJob] = deque()
        self.exhausted = False
        self.in_flight = 0

    def next(self) -> ConversationJob | None:
        if self.requeued:
            return self.requeued.popleft()
        if not self.exhausted:
            try:
                return next(self.jobs)
            except StopIteration:
                self.exhausted = True
        return None

    @property
    def left(self) -> int:
        """At least this many conversations are not done: the requeued ones, and one more if the input is not over."""
        return len(self.requeued) + (0 if self.exhausted else 1)


class OpenAIBackend:
    """The servers of ``regenerate.endpoints``, sampling and retrying as the ``regenerate`` settings say."""

    name = "openai"

    def __init__(self, options: RegenerateSettings, model_path: Path, *, trust_remote_code: bool = False) -> None:
        self.options = options
        self.model_path = Path(model_path)
        self.sampling: dict[str, Any] = {
            "max_tokens": options.max_tokens,
            "temperature": options.temperature,
            "top_p": options.top_p,
        }
        if options.seed is not None:
            self.sampling["seed"] = options.seed
        if options.chat_template_kwargs:
            self.sampling["chat_template_kwargs"] = dict(options.chat_template_kwargs)
        self.chat_template_kwargs = dict(options.chat_template_kwargs)
        self.trust_remote_code = trust_remote_code
        self.endpoints: list[_Endpoint] = []
        key = os.environ.get(options.api_key_env) if options.api_key_env else None
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    # -- before any work -------------------------------------------------------------------------

    def wanted_names(self) -> list[str]:
        if self.options.served_model:
            return [self.options.served_model]
        return [str(self.model_path), self.model_path.name]

    def preflight(self) -> dict[str, Any]:
        """Every endpoint reachable and serving the target, or an error naming the URL."""
        self.endpoints = []
        served: dict[str, str] = {}
        timeout = httpx.Timeout(self.options.connect_timeout_s * 3, connect=self.options.connect_timeout_s)
        with httpx.Client(timeout=timeout, headers=self.headers) as client:
            for url in self.options.endpoints:
                try:
                    response = client.get(f"{url}/models")
                except httpx.HTTPError as exc:
                    raise RegenerationError(
                        f"{url}: cannot reach the server ({type(exc).__name__}: {exc}); start it, or remove it "
                        "from regenerate.endpoints"
                    ) from None
                if response.status_code != 200:
                    raise RegenerationError(
                        f"{url}/models answered HTTP {response.status_code}: {response.text[:300]!r}; is this an "
                        "OpenAI-compatible server (base URL ending in /v1)?"
                    )
                try:
                    ids = [entry["id"] for entry in response.json()["data"]]
                except (ValueError, KeyError, TypeError):
                    raise RegenerationError(
                        f"{url}/models: not an OpenAI model list: {response.text[:300]!r}"
                    ) from None
                model = self._match(ids)
                if model is None:
                    raise RegenerationError(
                        f"{url} serves {ids}, not the target model {self.model_path} (accepted names: "
                        f"{self.wanted_names()}); start the server with the target (vLLM/SGLang: "
                        "--served-model-name NAME) and set regenerate.served_model: NAME"
                    )
                served[url] = model
                self.endpoints.append(_Endpoint(url, model))
        return {"endpoints": served}

    def _match(self, ids: list[str]) -> str | None:
        wanted = self.wanted_names()
        for name in wanted:
            if name in ids:
                return name
        if not self.options.served_model:  # a server started with the path written differently
            for served in ids:
                if Path(served).name == self.model_path.name:
                    return served
        return None

    # -- the work --------------------------------------------------------------------------------

    def run(self, jobs: Iterator[ConversationJob], finished: Callable[[ConversationJob], None], stats: Stats) -> None:
        if not self.endpoints:
            self.preflight()
        renderer = PromptRenderer(self.model_path, self.chat_template_kwargs, self.trust_remote_code)
        asyncio.run(self._run(jobs, finished, stats, renderer))

    async def _run(self, jobs, finished, stats: Stats, renderer: PromptRenderer) -> None:
        queue = _JobQueue(jobs)
        limits = httpx.Limits(
            max_connections=self.options.concurrency, max_keepalive_connections=self.options.concurrency
        )
        timeout = httpx.Timeout(self.options.request_timeout_s, connect=self.options.connect_timeout_s)
        clients = [httpx.AsyncClient(timeout=timeout, limits=limits, headers=self.headers) for _ in self.endpoints]
        try:
            for endpoint in self.endpoints:
                stats.endpoint(endpoint.url)["alive"] = True
            tasks = [
                asyncio.create_task(self._worker(endpoint, client, queue, finished, stats, renderer))
                for endpoint, client in zip(self.endpoints, clients)
                for _ in range(self.options.concurrency)
            ]
            try:
                await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
        finally:
            for client in clients:
                await client.aclose()
        if queue.requeued or not queue.exhausted:
            down = "; ".join(f"{e.url}: {e.last_error}" for e in self.endpoints)
            raise RegenerationError(
                f"no endpoint left ({down}); at least {queue.left} conversations are not regenerated. Everything "
                "finished so far is committed: start the servers and run again to finish the rest"
            )

    async def _worker(
        self, endpoint: _Endpoint, client: httpx.AsyncClient, queue: _JobQueue, finished, stats: Stats, renderer
    ) -> None:
        """Conversations one after another on ``endpoint`` while it is up; one whose endpoint went down goes back
        to the queue for the others."""
        while endpoint.alive:
            job = queue.next()
            if job is None:
                if queue.in_flight == 0 and not queue.requeued:
                    return
                await asyncio.sleep(0.05)  # a conversation in flight elsewhere may come back
                continue
            queue.in_flight += 1
            try:
                await self._conversation(endpoint, client, job, stats, renderer)
            except _EndpointDown:
                queue.requeued.append(job)
                continue
            finally:
                queue.in_flight -= 1
            stats.endpoint(endpoint.url)["conversations"] += 1
            finished(job)

    async def _conversation(
        self, endpoint: _Endpoint, client: httpx.AsyncClient, job: ConversationJob, stats: Stats, renderer
    ) -> None:
        while not job.done:
            try:
                prompt = renderer.render(job)
            except Exception as exc:  # jinja raises many types; the template is the user's
                template_failure(job, exc)
                return
            body = {"model": endpoint.model, "messages": job.prompt(), **self.sampling}
            if job.tools:
                body["tools"] = job.tools
            try:
                generated = await self._request(endpoint, client, body, stats, opens_think(prompt))
            except _RequestFailed as exc:
                job.fail(exc.reason, f"messages[{job.pending[0]}]: {exc.detail} ({endpoint.url})")
                return
            stats.endpoint(endpoint.url)["generated_tokens"] += generated.completion_tokens
            job.accept(generated)

    async def _request(
        self, endpoint: _Endpoint, client: httpx.AsyncClient, body: dict, stats: Stats, prompt_opens_think: bool
    ) -> Generated:
        counters = stats.endpoint(endpoint.url)
        attempt = 0
        while True:
            if not endpoint.alive:
                raise _EndpointDown(endpoint.url)
            counters["requests"] += 1
            try:
                response = await client.post(f"{endpoint.url}/chat/completions", json=body)
            except _UNREACHABLE as exc:
                counters["errors"] += 1
                if attempt >= self.options.retries:
                    endpoint.alive = False
                    counters["alive"] = False
                    endpoint.last_error = f"{type(exc).__name__}: {exc}"
                    raise _EndpointDown(endpoint.url) from None
                kind, detail = "unreachable", f"{type(exc).__name__}: {exc}"
            except httpx.TimeoutException as exc:
                counters["errors"] += 1
                if attempt >= self.options.retries:
                    raise _RequestFailed(
                        FailureReason.TIMEOUT,
                        f"no response within {self.options.request_timeout_s:g} s after {attempt + 1} tries "
                        f"({type(exc).__name__})",
                    ) from None
                kind, detail = "timeout", str(exc)
            else:
                if response.status_code == 200:
                    return _parse(response, prompt_opens_think)
                counters["errors"] += 1
                text = response.text[:500]
                if response.status_code != 429 and response.status_code < 500:
                    raise _RequestFailed(FailureReason.BAD_REQUEST, f"HTTP {response.status_code}: {text}")
                if attempt >= self.options.retries:
                    raise _RequestFailed(
                        FailureReason.SERVER_ERROR, f"HTTP {response.status_code} after {attempt + 1} tries: {text}"
                    )
                kind, detail = f"HTTP {response.status_code}", text
            delay = min(self.options.backoff_s * 2**attempt, MAX_BACKOFF_S) * (0.5 + random.random() / 2)
            endpoint.last_error = f"{kind}: {detail}"
            attempt += 1
            await asyncio.sleep(delay)


def _parse(response: httpx.Response, prompt_opens_think: bool) -> Generated:
    try:
        payload = response.json()
        choice = payload["choices"][0]
        message = choice.get("message") or {}
    except (ValueError, KeyError, IndexError, TypeError):
        raise _RequestFailed(FailureReason.SERVER_ERROR, f"not a chat completion: {response.text[:300]!r}") from None
    content = message.get("content") or ""
    # Reasoning parsers put the reasoning beside the content (vLLM and SGLang: reasoning_content; newer
    # vLLM: reasoning); without one it is inline, as <think>...</think>.
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning is None:
        reasoning, content = split_reasoning(content, prompt_opens_think)
    else:
        content = content.strip()
        reasoning = reasoning.strip()
    usage = payload.get("usage") or {}
    return Generated(
        content=content,
        reasoning_content=reasoning or None,
        finish_reason=str(choice.get("finish_reason") or "unknown"),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        tool_calls=message.get("tool_calls") or None,
    )
