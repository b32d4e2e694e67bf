"""Core pieces of the per-message tools: delete one message (its follower moves up),
select the path to a found message, the fenced code blocks of a message, the external
editor, and the draft's token count."""

from __future__ import annotations

import os
import stat
import sys

import pytest
from fakes import FakeEngine
from tierchat.core.chat.code_blocks import CodeBlock, fenced_blocks
from tierchat.core.chat.conversation_settings import ConversationSettings
from tierchat.core.chat.draft import count_draft
from tierchat.core.chat.editor import EditorError, edit_text, editor_command
from tierchat.core.chat.session import ChatSession
from tierchat.core.chat.store import ConversationError, ConversationStore
from tierchat.core.sampling_params import SamplingParams


@pytest.fixture
def store():
    s = ConversationStore(":memory:")
    yield s
    s.close()


def chain(store, *texts):
    cid = store.create_conversation("t")
    parent, nodes = None, []
    for i, text in enumerate(texts):
        nodes.append(store.add_node(cid, parent, "user" if i % 2 == 0 else "assistant", text))
        parent = nodes[-1].id
    return cid, nodes


def contents(nodes):
    return [n.content for n in nodes]


# ---------------------------------------------------------------- delete one message


def test_delete_message_keeps_what_follows(store):
    cid, (u0, a0, u1, a1) = chain(store, "q0", "a0", "q1", "a1")
    moved = store.delete_message(u1.id)
    assert moved.id == a1.id and moved.parent_id == a0.id
    assert contents(store.active_path(cid)) == ["q0", "a0", "a1"]
    store.delete_message(u0.id)  # a root: its child becomes the selected root
    assert contents(store.active_path(cid)) == ["a0", "a1"]
    assert store.delete_message(a1.id) is None  # a leaf
    assert contents(store.active_path(cid)) == ["a0"]


def test_delete_message_of_an_unselected_sibling_keeps_the_selection(store):
    cid, (u0, a0) = chain(store, "q", "first")
    b = store.add_node(cid, u0.id, "assistant", "second")
    store.add_node(cid, b.id, "user", "follow-up")
    store.select_child(u0.id, a0.id)
    store.delete_message(b.id)  # its follow-up moves under u0, a0 stays selected
    assert contents(store.active_path(cid)) == ["q", "first"]
    assert sorted(contents(store.children(u0.id))) == ["first", "follow-up"]


def test_delete_message_with_branches_after_it_is_refused(store):
    cid, (u0, a0) = chain(store, "q", "a")
    store.add_node(cid, u0.id, "assistant", "b")
    with pytest.raises(ConversationError, match="2 branches"):
        store.delete_message(u0.id)
    assert contents(store.active_path(cid)) == ["q", "b"]


def test_subtree_size_counts_every_branch_below(store):
    cid, (u0, a0, u1, a1) = chain(store, "q0", "a0", "q1", "a1")
    store.add_node(cid, u0.id, "assistant", "a0 again")
    assert store.subtree_size(u0.id) == 5 and store.subtree_size(a1.id) == 1
    with pytest.raises(ConversationError):
        store.subtree_size(999)


def test_select_path_makes_a_node_part_of_the_active_path(store):
    cid, (u0, a0, u1, a1) = chain(store, "q0", "a0", "q1", "a1")
    edited = store.add_node(cid, None, "user", "q0 edited")
    store.add_node(cid, edited.id, "assistant", "other")
    assert contents(store.active_path(cid)) == ["q0 edited", "other"]
    path = store.select_path(u1.id)
    assert contents(path) == ["q0", "a0", "q1"]
    assert contents(store.active_path(cid)) == ["q0", "a0", "q1", "a1"]
    with pytest.raises(ConversationError):
        store.select_path(9999)


# ---------------------------------------------------------------- code blocks


def test_fenced_blocks():
    text = "\n".join(
        [
            "Two ways:",
            "```python title='x'",
            "print(1)",
            "",
            "  indented",
            "```",
            "and",
            "  ~~~~",
            "  a",
            "   b",
            "~~~",  # shorter than the opening fence: content",
            "~~~~~",
            "``` not a fence ``` inline",
            "```sh",
            "cut off",
        ]
    )
    assert fenced_blocks(text) == [
        CodeBlock("python", "print(1)\n\n  indented", 1),
        CodeBlock("", "a\n b\n~~~", 7),
        CodeBlock("sh", "cut off", 13, closed=False),
    ]
    assert fenced_blocks("no code here") == []
    assert fenced_blocks("```\n```") == [CodeBlock("", "", 0)]


# ---------------------------------------------------------------- editor


def script(tmp_path, body: str) -> str:
    path = tmp_path / "editor.py"
    path.write_text(f"#!{sys.executable}\nimport sys\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_edit_text_runs_the_editor_on_a_private_file(tmp_path):
    editor = script(
        tmp_path,
        "import os, stat\n"
        "p = sys.argv[1]\n"
        "mode = stat.S_IMODE(os.stat(p).st_mode)\n"
        "old = open(p).read()\n"
        "open(p, 'w').write(old.upper() + f' {mode:o}\\n')",
    )
    assert edit_text("long prompt", command=[editor]) == "LONG PROMPT 600"
    assert not list(tmp_path.glob("tierchat-*"))


def test_edit_text_failures_are_editor_errors(tmp_path):
    with pytest.raises(EditorError, match="exited with status 3"):
        edit_text("x", command=[script(tmp_path, "sys.exit(3)")])
    with pytest.raises(EditorError, match="cannot run"):
        edit_text("x", command=[str(tmp_path / "no-such-editor")])


def test_editor_command_from_the_environment():
    assert editor_command({"VISUAL": "code --wait", "EDITOR": "nano"}) == ["code", "--wait"]
    assert editor_command({"EDITOR": "nano -R"}) == ["nano", "-R"]
    assert editor_command({}) == ["vi"]
    assert os.environ  # the default reads os.environ


# ---------------------------------------------------------------- draft count


def test_count_draft_is_the_prompt_send_builds(store):
    engine = FakeEngine("fake", context_length=64)
    try:
        session = ChatSession(
            engine, store, ConversationSettings(sampling=SamplingParams(max_tokens=4))
        )
        session.new_conversation(system="Be brief.")
        count = count_draft(session, "the cache")
        assert count.text_tokens == len(engine.tokenizer.encode("the cache"))
        turn = session.send("the cache")
        turn.wait(10)
        assert count.prompt_tokens == len(turn.request.prompt_ids)
        assert count.context_length == 64 and count.fraction == count.prompt_tokens / 64
        longer = count_draft(session, "x" * 80)
        assert longer.over and longer.prompt_tokens > 80
        engine.model_name = ""
        assert count_draft(session, "x") is None  # no model: no tokenizer to count with
    finally:
        engine.close()
