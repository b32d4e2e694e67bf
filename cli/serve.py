"""``tierchat serve``: parse and check the flags, start the engine, the server
(:mod:`tierchat.core.serve.app`) and the console, and stop in order on SIGTERM / SIGINT
(:mod:`tierchat.cli.serve_shutdown`). The routes, the guards and the server thread live in
``core/serve/``; this module holds no HTTP route or server class.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from typing import Any

from tierchat.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, CLIError, start_engine
from tierchat.core.sampling_params import SamplingParams
from tierchat.core.serve.app import create_app
from tierchat.core.serve.limits import is_loopback
from tierchat.core.serve.log import LIVE_STATUSES, RequestLog, RequestRecord, TrackedEngine
from tierchat.core.serve.server import ServerThread
from tierchat.core.serve.state import (
    API_KEY_ENV,
    ServeState,
    ranks_failure,
    reply_memory_path,
    responses_path,
)


def binds_loopback(host: str) -> bool:
    """Whether binding ``host`` binds loopback only: a loopback name or address
    (:func:`~tierchat.core.serve.limits.is_loopback`) whose every resolved address is
    loopback too (uvicorn binds each address the name resolves to, so a ``localhost``
    that a hosts file points elsewhere is not loopback). Raises CLIError when a loopback
    name does not resolve."""
    if not is_loopback(host):
        return False
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError) as e:
        hint = ": write an IPv6 address without brackets" if host.strip().startswith("[") else ""
        raise CLIError(f"--host {host!r} does not resolve ({e}){hint}", EXIT_USAGE) from None
    return all(is_loopback(str(info[4][0])) for info in infos)


def check_bind(host: str, allow_remote: bool, api_key: str | None) -> None:
    """Loopback is open (:func:`binds_loopback`); anything else, ``0.0.0.0`` and ``::``
    included, needs ``--allow-remote`` and a key. Raises CLIError."""
    if binds_loopback(host):
        return
    if not allow_remote:
        raise CLIError(
            f"--host {host} is not loopback: add --allow-remote (and an API key) to serve it",
            EXIT_USAGE,
        )
    if not api_key:
        raise CLIError(
            f"serving on {host} needs an API key: --api-key KEY or {API_KEY_ENV}", EXIT_USAGE
        )


def _print_record(record: RequestRecord) -> None:
    if record.status in LIVE_STATUSES:
        return
    m = record.metrics
    if not m.finish_reason:  # failed or cancelled before it finished: no metrics to show
        line = f"#{record.seq} {record.client} {record.endpoint} {record.status}: "
        line += f"prompt {m.prompt_tokens}, {record.error or 'no reply'}"
        print(line, file=sys.stderr, flush=True)
        return
    by = ", ".join(f"{k} {v}" for k, v in m.cached_by.items() if v) or "none"
    if m.restore_choice:  # why the SSD tier was read or not, e.g. "recompute 12K tok, ..."
        by += f"; {m.restore_choice}"
    line = (
        f"#{record.seq} {record.client} {record.endpoint} {record.status}: "
        f"prompt {m.prompt_tokens}, cached {m.cached_tokens} "
        f"({by}), prefilled {m.prefill_tokens}, "
        f"TTFT {m.ttft_s:.2f}s (+{record.wait_s:.2f}s queued), "
        f"{m.generation_tokens} tok at {m.generation_tps:.1f} tok/s"
    )
    if record.error:
        line += f" ({record.error})"
    print(line, file=sys.stderr, flush=True)


def run_serve(settings: Any, args: Any) -> int:
    """``tierchat serve``: load the model, serve until SIGTERM or SIGINT (Ctrl-C), or the
    console quits; then stop in order (:mod:`~tierchat.cli.serve_shutdown`)."""
    from tierchat.cli.common import SSDWatch, check_cache_owner
    from tierchat.cli.serve_shutdown import Shutdown
    from tierchat.core.live_status import StatusService
    from tierchat.core.serve.limits import limits_from_args

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    check_bind(args.host, args.allow_remote, api_key)
    for pattern in getattr(args, "system_line_filter", None) or ():
        try:
            re.compile(pattern)
        except re.error as e:
            raise CLIError(f"--system-line-filter {pattern!r}: {e}", EXIT_USAGE) from None
    check_cache_owner(settings)
    engine = start_engine(settings)
    log = RequestLog()
    tracked = TrackedEngine(engine, log)
    limits = limits_from_args(args)
    given = getattr(args, "system_line_filter", None)
    filters = {"system_line_filters": tuple(f for f in given if f)} if given is not None else {}
    state = ServeState(
        tracked,
        api_key=api_key,
        # the config's max_tokens; its seed only when --seed is given (clients' own otherwise)
        sampling=SamplingParams(
            max_tokens=settings.sampling.max_tokens,
            seed=settings.sampling.seed if "seed" in args else None,
        ),
        use_cache=not settings.no_cache,
        max_queue=args.max_queue,
        memory_path=reply_memory_path(settings, engine.model_name),
        responses_dir=responses_path(settings, engine.model_name),
        limits=limits,
        bind_host=args.host,
        **filters,
    )
    app = create_app(state)
    try:
        server = ServerThread(app, args.host, args.port, limits).start()
    except RuntimeError as e:
        engine.close()
        raise CLIError(f"{e} (is the port in use?)") from None
    log.url = f"{server.url}/v1"
    status = StatusService(engine, settings.cache_dir, "serve").start()
    shutdown = Shutdown(state, server, engine, bound_s=getattr(args, "shutdown_s", 10.0))
    try:
        with shutdown.signals():
            if args.console:
                _run_console(tracked, log, settings, shutdown)
            else:
                log.subscribe(_print_record)
                print(
                    f"tierchat serve: {log.url} · model {engine.model_name} · "
                    "Ctrl-C or SIGTERM stops",
                    file=sys.stderr,
                    flush=True,
                )
                watch = SSDWatch(engine)
                while server.thread.is_alive() and not shutdown.requested.is_set():
                    server.thread.join(0.5)
                    watch.check()
                    failed = ranks_failure(engine)
                    if failed:  # no request can run again: stop, and exit 1
                        shutdown.fail(failed)
            status.stop()
            shutdown.run()
    except BaseException:
        status.stop()
        server.stop()
        engine.close()
        raise
    return EXIT_FAILED if shutdown.failure else EXIT_OK


def _run_console(engine: TrackedEngine, log: RequestLog, settings: Any, shutdown: Any) -> None:
    """The console on the main thread; a signal quits it, then the server stops."""
    try:
        from tierchat.tui.screens.serve_console import ServeConsoleApp
    except ImportError as e:
        raise CLIError(f"the console is not available ({e})") from None
    from tierchat.cli.common import open_store
    from tierchat.cli.serve_shutdown import quit_ui_later

    store = open_store(settings.db_path, settings.store_busy_s)
    try:
        app = ServeConsoleApp(engine, store, settings, log)
        shutdown.on_request = quit_ui_later(app)
        app.run()
    finally:
        store.close()
