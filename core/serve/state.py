"""What the routes of ``tierchat serve`` share (:class:`ServeState`): the tracked engine,
its log, the reply memory, the stored responses, the limits and defaults; where the reply
memory lives; who a client is. Every adapter (OpenAI chat and completions, Anthropic
Messages, Responses) and helper of :mod:`tierchat.core.serve` imports it from here, down:
nothing imports the app (docs/DESIGN.md §15).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import time
from pathlib import Path
from typing import Any, Protocol

from starlette.requests import Request

from ..chat.prompts import PromptBuilder
from ..sampling_params import SamplingParams
from ..text import log_safe
from .limits import ServeLimits
from .log import TrackedEngine
from .prompts import APIError, ReplyMemory
from .response_store import ResponseStore

# a stopping server is back, if it is restarted, after its model loads: not within 1 s
SHUTDOWN_RETRY_AFTER_S = 10

API_KEY_ENV = "TIERCHAT_API_KEY"
# lines removed from every system message before its prompt is built (request.py
# normalize_system): Claude Code's per-version billing line would change the prompt's
# first tokens with every client release and session
SYSTEM_LINE_FILTERS: tuple[str, ...] = (r"^x-anthropic-billing-header:.*$",)
MAX_NEW_RENDERS = (
    64  # prefix renders per request: prompt building stays linear (docs/DESIGN.md §15)
)


class Abortable(Protocol):
    """An open generation, as the state sees it (:class:`~tierchat.core.serve.generation
    .Generation`)."""

    def abort(self, error: APIError) -> None: ...


class ServeState:
    """What the routes share: the tracked engine, the log, the reply memory, defaults."""

    def __init__(
        self,
        engine: TrackedEngine,
        *,
        api_key: str | None = None,
        sampling: SamplingParams | None = None,
        use_cache: bool = True,
        max_queue: int = 64,
        memory_entries: int = 256,
        memory_path: str | os.PathLike | None = None,
        limits: ServeLimits | None = None,
        bind_host: str = "127.0.0.1",
        build_slots: int = 2,
        responses_dir: str | os.PathLike | None = None,
        keepalive_s: float = 10.0,
        system_line_filters: tuple[str, ...] = SYSTEM_LINE_FILTERS,
    ) -> None:
        self.engine = engine
        self.limits = limits or ServeLimits()
        self.bind_host = bind_host
        self.build_slots = build_slots
        self._build_sem: asyncio.Semaphore | None = None
        self.draining = False  # a signal came: new requests get 503
        self.generations: set[Abortable] = set()
        self.log = engine.log
        self.api_key = api_key
        # a request's sampling where its body says nothing (max_tokens, seed: the flags)
        self.sampling = sampling if sampling is not None else SamplingParams()
        self.use_cache = use_cache
        self.max_queue = max_queue
        self.memory = ReplyMemory(memory_entries, memory_path)
        self.responses_dir = Path(responses_dir) if responses_dir is not None else None
        # stored Responses API responses (previous_response_id); None: nothing is stored
        self.responses = ResponseStore(self.responses_dir) if self.responses_dir else None
        # SSE keep-alives while a stream waits or prefills (docs/DESIGN.md §15)
        self.keepalive_s = keepalive_s
        for pattern in system_line_filters:
            re.compile(pattern)  # a bad pattern fails here, not in a request
        self.system_line_filters = tuple(system_line_filters)
        self.created = int(time.time())
        self._builder: PromptBuilder | None = None

    def builder(self) -> PromptBuilder:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise APIError(
                "no model is loaded", 503, "server_error", code="model_not_loaded", retry_after_s=5
            )
        if self._builder is None or self._builder.tokenizer is not tokenizer:
            self._builder = PromptBuilder(tokenizer, max_renders=MAX_NEW_RENDERS, check_whole=False)
        return self._builder

    def build_semaphore(self) -> asyncio.Semaphore:
        """At most ``build_slots`` prompts are built at once (on threads), so many large
        requests cannot starve the event loop's threads or the engine's callers."""
        if self._build_sem is None:
            self._build_sem = asyncio.Semaphore(self.build_slots)
        return self._build_sem

    def abort_all(self, message: str) -> int:
        """End every open generation with a 503 ``server_shutting_down`` error (streams get
        it as an error event) and cancel it on the engine. Any thread. Returns how many."""
        error = APIError(
            message,
            503,
            "server_error",
            code="server_shutting_down",
            retry_after_s=SHUTDOWN_RETRY_AFTER_S,
        )
        gens = list(self.generations)
        for gen in gens:
            gen.abort(error)
        return len(gens)


def reply_memory_path(settings: Any, model_name: str) -> Path:
    """Where the server keeps its reply memory for ``model_name``: one file per model
    under the data dir (``serve-replies/<sha256(model)[:16]>.jsonl``)."""
    digest = hashlib.sha256(model_name.encode()).hexdigest()[:16]
    return Path(settings.data_dir) / "serve-replies" / f"{digest}.jsonl"


def responses_path(settings: Any, model_name: str) -> Path:
    """Where the server stores Responses API responses for ``previous_response_id``: one
    owner-only dir per model under the data dir (``serve-responses/<sha256(model)[:16]>``)."""
    digest = hashlib.sha256(model_name.encode()).hexdigest()[:16]
    return Path(settings.data_dir) / "serve-responses" / digest


def ranks_failure(engine: Any) -> str:
    """Why the ranks failed (a rank lost, or silent past ``--rank-timeout``), "" while
    they work or when there is one rank (docs/DESIGN.md §19)."""
    failed = getattr(getattr(engine, "peers", None), "failed", "")
    return failed if isinstance(failed, str) else ""


def client_label(request: Request, body: dict) -> str:
    """``host label``: the request's ``user`` field, else the User-Agent's product; control
    characters escaped (:func:`~tierchat.core.text.log_safe`), as it goes to logs."""
    host = request.client.host if request.client else "?"
    user = body.get("user")
    if isinstance(user, str) and user:
        return f"{host} {log_safe(user[:24])}"
    agent = request.headers.get("user-agent", "").split(" ")[0]
    return f"{host} {log_safe(agent[:24])}" if agent else host
