"""A Responses API body as the one internal request (docs/DESIGN.md §15): its input
items, instructions, tools and settings as a :class:`~tierchat.core.serve.request
.ChatRequest` whose messages are those the same conversation has in OpenAI chat form
(``role``, ``content``, ``tool_calls``, ``tool_call_id``, ``reasoning_content``), so both
APIs give the same prompt ids. What each field becomes: :mod:`tierchat.core.serve
.responses_api`. Pure Python: no HTTP, no MLX.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

from .openai_api import ROLES, text_content
from .prompts import APIError, sampling_params, stream_options
from .request import ChatRequest, check_tools
from .state import ServeState

NO_THINKING = ("none", "minimal")  # reasoning.effort values that turn thinking off
UNSUPPORTED_PARTS = ("input_image", "input_file", "input_audio")


def input_items(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``input`` as a list of items (a string is one user message). Raises :class:`APIError`."""
    raw = body.get("input")
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list) or not all(isinstance(i, Mapping) for i in raw):
        raise APIError("'input' must be a string or a list of items", param="input")
    return [dict(i) for i in raw]


def _part_text(content: Any, param: str) -> str:
    if isinstance(content, list):
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind in UNSUPPORTED_PARTS:
                raise APIError(
                    f"content parts of type {kind!r} are not supported (text only)",
                    param=f"{param}.{i}",
                    code="unsupported_content",
                )
    return text_content(content, param)


def _reasoning_text(item: Mapping[str, Any]) -> str:
    parts = item.get("content") or item.get("summary") or []
    texts = (
        [p.get("text") for p in parts if isinstance(p, Mapping)] if isinstance(parts, list) else []
    )
    return "\n\n".join(t for t in texts if isinstance(t, str) and t)


def to_messages(items: list[dict[str, Any]], instructions: Any = None) -> tuple[dict, ...]:
    """The internal messages (OpenAI chat's form) of Responses ``items``, after
    ``instructions`` as a system message. Function calls right after an assistant message
    (or each other) join its ``tool_calls``, as OpenAI chat holds them. Raises
    :class:`APIError` 400 for an item it cannot read."""
    out: list[dict[str, Any]] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise APIError("'instructions' must be a string", param="instructions")
        out.append({"role": "system", "content": instructions})
    reasoning = ""  # of the next assistant message
    open_turn = False  # the last message is an assistant one that calls may join
    for i, item in enumerate(items):
        param = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(item.get("role")) if isinstance(item.get("role"), str) else None
            if role is None or role == "tool":
                raise APIError(
                    f"input[{i}].role must be user, assistant, system or developer",
                    param=f"{param}.role",
                )
            msg = {"role": role, "content": _part_text(item.get("content"), f"{param}.content")}
            if role == "assistant" and reasoning:
                msg["reasoning_content"], reasoning = reasoning, ""
            out.append(msg)
            open_turn = role == "assistant"
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments", "{}"), item.get("call_id")
            if not isinstance(name, str) or not name or not isinstance(call_id, str):
                raise APIError("a function_call item needs name and call_id", param=param)
            if not isinstance(args, str):
                args = json.dumps(args, ensure_ascii=False)
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
            if not open_turn:
                out.append({"role": "assistant", "content": ""})
                open_turn = True
            if reasoning:
                out[-1]["reasoning_content"], reasoning = reasoning, ""
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise APIError("a function_call_output item needs call_id", param=param)
            text = _part_text(item.get("output"), f"{param}.output")
            out.append({"role": "tool", "content": text, "tool_call_id": call_id})
            open_turn = False
        elif kind == "reasoning":
            reasoning = _reasoning_text(item)
        else:
            raise APIError(f"input items of type {str(kind)[:40]!r} are not supported", param=param)
    return tuple(out)


def function_tools(raw: Any) -> tuple[tuple[dict[str, Any], ...], list[str]]:
    """Responses tools as OpenAI chat function tools, and the kinds skipped (tools this
    server cannot run, such as ``web_search``). Raises :class:`APIError` 400."""
    if raw is None:
        return (), []
    if not isinstance(raw, list):
        raise APIError("'tools' must be a list", param="tools")
    chat, skipped = [], []
    for tool in raw:
        if isinstance(tool, Mapping) and tool.get("type") == "function":
            chat.append(
                {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
            )
        else:
            skipped.append(str(tool.get("type") if isinstance(tool, Mapping) else tool)[:40])
    return check_tools(chat), skipped


def tool_choice(raw: Any) -> tuple[str, str | None]:
    """``(choice, forced name)``: ``auto``, ``none``, ``required`` or
    ``{"type": "function", "name"}``."""
    if raw is None or raw in ("auto", "none", "required"):
        return raw or "auto", None
    if (
        isinstance(raw, Mapping)
        and raw.get("type") == "function"
        and isinstance(raw.get("name"), str)
    ):
        return "required", raw["name"]
    raise APIError("'tool_choice' must be auto, none, required or a function", param="tool_choice")


def chat_request(
    body: Mapping[str, Any], items: list[dict[str, Any]], state: ServeState
) -> ChatRequest:
    """The internal request of a Responses ``body`` whose resolved input is ``items``."""
    for name in ("background", "conversation", "prompt"):
        if body.get(name):
            raise APIError(f"'{name}' is not supported by this server", param=name)
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), Mapping) else None
    if isinstance(fmt, Mapping) and fmt.get("type", "text") != "text":
        raise APIError(
            f"text.format {str(fmt.get('type'))[:40]!r} is not supported (text only)",
            param="text.format",
            code="unsupported_parameter",
        )
    values = {k: body.get(k) for k in ("temperature", "top_p")}
    values["max_tokens"] = body.get("max_output_tokens")
    params = sampling_params(values, state.sampling, {"max_tokens": "max_output_tokens"})
    stream, _ = stream_options({"stream": body.get("stream", False)})
    tools, skipped = function_tools(body.get("tools"))
    if skipped:
        print(
            f"responses: skipped tools this server cannot run: {', '.join(skipped)}",
            file=sys.stderr,
        )
    choice, forced = tool_choice(body.get("tool_choice")) if tools else ("none", None)
    effort = (
        (body.get("reasoning") or {}).get("effort")
        if isinstance(body.get("reasoning"), Mapping)
        else None
    )
    return ChatRequest(
        messages=to_messages(items, body.get("instructions")),
        sampling=params,
        stream=stream,
        tools=tools,
        tool_choice=choice,  # type: ignore[arg-type]
        forced_tool=forced,
        parallel_tool_calls=body.get("parallel_tool_calls", True) is not False,
        enable_thinking=False if effort in NO_THINKING else None,
        max_tokens_explicit=body.get("max_output_tokens") is not None,
        param="input",
    )
