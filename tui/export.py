"""Export a conversation -- its active path or its whole tree -- to Markdown or JSON.

Pure Python over a ``ConversationStore``. JSON carries everything the store holds (ids,
roles, content, generated token ids, meta with the turn's metrics, the selected branch);
Markdown is for reading: the active path as a chat, or the tree as an outline where the
branches on the active path are marked ``●``; a step's tool calls are listed under it and a
tool result is shown as a code block headed by its tool (errors, denials and cancels
marked); user and system text is escaped so that it
renders as typed (replies are the model's Markdown). A message cut inside a code block (a
stopped reply, the token cap) gets its fence closed, so the rest of the file stays text.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Literal

from tierchat.core.chat.store import ConversationStore, Node
from tierchat.core.files import private_dirs, private_open

ExportFormat = Literal["md", "json"]
ExportScope = Literal["path", "tree"]

ROLE_TITLES = {"system": "System", "user": "You", "assistant": "Assistant", "tool": "Tool"}

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")


def close_fences(text: str) -> str:
    """``text`` with a closing fence added when it ends inside a fenced code block.

    Fences as CommonMark defines them (spec 0.31, "Fenced code blocks"): an opening line
    of three or more backticks or tildes, indented at most three spaces (a backtick
    fence's info string holds no backtick); the block closes at a line of the same
    character, at least as long, with nothing but spaces after it. Text that closes its
    blocks is returned unchanged.
    """
    open_fence = ""
    for line in text.splitlines():
        match = _FENCE.match(line)
        if match is None:
            continue
        fence, rest = match.groups()
        if not open_fence:
            if not (fence[0] == "`" and "`" in rest):
                open_fence = fence
        elif fence[0] == open_fence[0] and len(fence) >= len(open_fence) and not rest.strip():
            open_fence = ""
    if not open_fence:
        return text
    return text + ("" if text.endswith("\n") else "\n") + open_fence


_INLINE = re.compile(r"([\\`*_\[\]<>|~&])")
_LINE_START = re.compile(r"^(\s*)([#+\-=>]|\d+[.)])")


def literal_markdown(text: str) -> str:
    """``text`` as Markdown that renders it as typed: every character that CommonMark
    reads as markup inline (emphasis, code, links, raw HTML, entities, tables, strikes)
    is backslash-escaped, a line that would open a heading, list, quote or setext
    underline gets its first mark escaped, and each line break is a hard break
    (a backslash at the end of the line, CommonMark 0.31 "Hard line breaks")."""
    out = []
    for line in text.strip("\n").split("\n"):
        line = _INLINE.sub(r"\\\1", line)
        match = _LINE_START.match(line)
        if match is not None:
            mark = match.group(2)
            escaped = mark[:-1] + "\\" + mark[-1] if mark[0].isdigit() else "\\" + mark
            line = match.group(1) + escaped + line[match.end() :]
        out.append(line)
    return "\\\n".join(out)


def code_block(text: str) -> str:
    """``text`` in a fence longer than any backtick run inside it."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}\n{text.rstrip()}\n{fence}"


def _tool_title(node: Node) -> str:
    """``server.tool`` of a tool result and how it ended (`` · error``...)."""
    meta = node.meta or {}
    name = f"{meta['server']}.{meta['tool']}" if meta.get("server") else meta.get("name", "tool")
    for flag in ("cancelled", "denied", "timed_out"):
        if meta.get(flag):
            return f"{name} · {flag.replace('_', ' ')}"
    return name + (" · error" if meta.get("is_error") else "")


def _calls_markdown(node: Node) -> list[str]:
    """One line per tool call of an assistant step: ``→ `name` `{"arguments"}```."""
    out = []
    for call in (node.meta or {}).get("tool_calls") or ():
        fn = call.get("function") or {}
        args = " ".join(str(fn.get("arguments", "")).split()).replace("`", "'")
        out.append(f"→ calls `{fn.get('name', '?')}` with `{args}`")
    return out


def _body_markdown(node: Node, *, strip: bool = False) -> str:
    """A message's body as the Markdown export shows it (``strip``: its content without
    surrounding whitespace, as the outline shows it)."""
    content = node.content.strip() if strip else node.content
    if node.role == "tool":
        return code_block(content)
    if node.role == "assistant":
        lines = [close_fences(content)] if content.strip() else []
        calls = _calls_markdown(node)
        return "\n\n".join(lines + (["\\\n".join(calls)] if calls else []))
    return literal_markdown(content)


def _node_dict(node: Node, *, active: bool) -> dict[str, Any]:
    return {
        "id": node.id,
        "parent_id": node.parent_id,
        "role": node.role,
        "content": node.content,
        "token_ids": list(node.token_ids) if node.token_ids is not None else None,
        "created_at": node.created_at,
        "meta": node.meta,
        "active": active,
    }


def _tree(store: ConversationStore, cid: int) -> tuple[list[Node], dict[int | None, list[Node]]]:
    children: dict[int | None, list[Node]] = {}
    roots = store.roots(cid)
    stack = list(roots)
    while stack:
        node = stack.pop()
        kids = store.children(node.id)
        children[node.id] = kids
        stack.extend(kids)
    return roots, children


def export_conversation(
    store: ConversationStore,
    conversation_id: int,
    fmt: ExportFormat,
    scope: ExportScope,
    settings: dict[str, Any] | None = None,
) -> str:
    """The conversation as text. Raises ``ConversationError`` for an unknown id."""
    info = store.get_conversation(conversation_id)
    title = info.title or f"conversation {info.id}"
    path = store.active_path(conversation_id)
    active = {n.id for n in path}
    if fmt == "json":
        doc: dict[str, Any] = {
            "format": "tierchat-conversation",
            "version": 1,
            "id": info.id,
            "title": title,
            "created_at": info.created_at,
            "updated_at": info.updated_at,
            "settings": settings or {},
            "scope": scope,
        }
        if scope == "path":
            doc["messages"] = [_node_dict(n, active=True) for n in path]
        else:
            roots, children = _tree(store, conversation_id)

            def nest(node: Node) -> dict[str, Any]:
                d = _node_dict(node, active=node.id in active)
                d["children"] = [nest(c) for c in children.get(node.id, [])]
                return d

            doc["roots"] = [nest(r) for r in roots]
        return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"

    lines = [f"# {literal_markdown(' '.join(title.split()))}", ""]
    system = (settings or {}).get("system")
    if system and not (path and path[0].role == "system"):
        lines += ["## System", "", literal_markdown(system), ""]
    if scope == "path":
        for node in path:
            model = (node.meta or {}).get("model")
            head = ROLE_TITLES.get(node.role, node.role)
            if node.role == "tool":
                head += f" · {_tool_title(node)}"
            title = f"## {head}" + (f" · {model}" if model else "")
            lines += [title, "", _body_markdown(node), ""]
        return "\n".join(lines).rstrip() + "\n"

    roots, children = _tree(store, conversation_id)
    lines += ["Branches on the active path are marked ●.", ""]

    def walk(node: Node, depth: int) -> None:
        mark = "●" if node.id in active else "○"
        text = _body_markdown(node, strip=True)
        if node.role == "tool":
            text = f"({_tool_title(node)})\n{text}"
        text = text.replace("\n", "\n" + "  " * (depth + 1) + "  ")
        lines.append(f"{'  ' * depth}- {mark} **{ROLE_TITLES.get(node.role, node.role)}**: {text}")
        for child in children.get(node.id, []):
            walk(child, depth + 1)

    for root in roots:
        walk(root, 0)
    return "\n".join(lines).rstrip() + "\n"


def export_path(folder: Path, title: str, conversation_id: int, fmt: str, scope: str) -> Path:
    """``<folder>/<slug>-<id>-<scope>.<fmt>``."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", title).strip("-").lower()[:40] or "conversation"
    return Path(folder) / f"{slug}-{conversation_id}-{scope}.{fmt}"


def write_export(store: ConversationStore, data_dir: Path, cid: int, fmt: str, scope: str) -> Path:
    """Write conversation ``cid`` (``scope`` "path" or "tree", ``fmt`` "md" or "json")
    under ``data_dir``/exports; returns the file written. Owner-only, as everything
    tierchat writes: the folder 0700, the file 0600. Raises ``OSError``, or the store's
    error for an unknown conversation."""
    info = store.get_conversation(cid)
    saved = store.conversation_settings(cid)
    text = export_conversation(store, cid, fmt, scope, saved)  # type: ignore[arg-type]
    folder = Path(data_dir) / "exports"
    private_dirs(folder, tighten=True)
    path = export_path(folder, info.title or "", cid, fmt, scope)
    with private_open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) as f:
        f.write(text)
    return path
