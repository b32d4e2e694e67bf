"""Tool rounds on a real tiny engine (``tiny:qwen2``: its template renders tools and
``<tool_call>`` JSON calls) with recorded model outputs (``engine_kit.ScriptedEngine``: the
prompt, prefill and cache are real, the sampled tokens given): the tree keeps each round,
the next step prefills only the results and a generation prompt, a regenerate of the step
after a result restores the whole path, and every bad call gets a result the model reads
(core/chat/tool_rounds.py, docs/DESIGN.md §12.1). Tools run on a stub host here; the real
MCP servers are tests/system/test_mcp_host.py's."""

from __future__ import annotations

import concurrent.futures
import json

import pytest
from engine_kit import ScriptedEngine, assert_same, make_engine
from tierchat.core.api import GenerateRequest
from tierchat.core.chat.conversation_settings import ConversationSettings
from tierchat.core.chat.session import ChatSession
from tierchat.core.chat.store import ConversationStore
from tierchat.core.chat.tool_rounds import Decision, ToolRounds
from tierchat.core.tools.config import ServerConfig
from tierchat.core.tools.mcp_host import CallHandle, ServerStatus, ToolInfo, ToolResult

ECHO = ToolInfo(
    "kit",
    "echo",
    "echo",
    "Return the text, prefixed.",
    {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
)


def call_text(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


class StubHost:
    """The part of McpHost ToolRounds uses: one server "kit" with ``echo``; calls answer at
    once (``cancel_next``: the next call comes back cancelled)."""

    configs = [ServerConfig("kit", "stdio", command="unused")]

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.cancel_next = False

    def tools(self, servers=None):
        return [ECHO] if servers is None or "kit" in servers else []

    def specs(self, servers):
        return [t.spec() for t in self.tools(servers)]

    def status(self):
        return [ServerStatus("kit", "stdio", "ready", "", (ECHO,))]

    def call(self, tool, arguments, timeout_s):
        self.calls.append((tool.display, arguments))
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self.cancel_next:
            self.cancel_next = False
            future.cancel()
        else:
            future.set_result(ToolResult("echo: " + arguments["text"]))
        return CallHandle(future, tool)


@pytest.fixture(scope="module")
def engine(tmp_path_factory, models_dir):
    e = make_engine("tiny:qwen2", tmp_path_factory.mktemp("rounds"), models_dir)
    yield e
    e.close()


@pytest.fixture
def chat(engine):
    """(scripted engine, session, rounds, stub host) over a fresh store and a cleared cache."""
    engine.clear("all")
    scripted = ScriptedEngine(engine)
    store = ConversationStore(":memory:")
    defaults = ConversationSettings.of(max_tokens=96, swipe_temperature=0.0, tools=("kit",))
    session = ChatSession(scripted, store, defaults)
    host = StubHost()
    rounds = ToolRounds(session, host, max_rounds=3)
    yield scripted, session, rounds, host
    store.close()


def finished(turn):
    turn.wait(120)
    assert turn.reply_node is not None, turn.error
    return turn.reply_node


def test_a_round_is_stored_and_the_next_step_prefills_only_the_result(chat):
    scripted, session, rounds, host = chat
    scripted.replies += [call_text("echo", '{"text": "hi"}'), "It said: echo: hi."]
    step = finished(session.send("Say hi through echo."))
    (call,) = step.meta["tool_calls"]
    assert call["function"] == {"name": "echo", "arguments": '{"text": "hi"}'}
    assert step.content == ""  # the call's markup is not visible text

    state = rounds.state(step)
    assert state.step == "run" and [c.display for c in state.calls] == ["kit.echo"]
    assert rounds.resolve(state, lambda c: Decision("once"))
    assert host.calls == [("kit.echo", {"text": "hi"})]
    answer_turn = rounds.next_round(state)
    answer = finished(answer_turn)

    path = session.active_path()
    assert [n.role for n in path] == ["user", "assistant", "tool", "assistant"]
    result = path[2]
    assert result.content == "echo: hi"
    assert result.meta["tool_call_id"] == call["id"]
    assert (result.meta["server"], result.meta["tool"], result.meta["is_error"]) == (
        "kit",
        "echo",
        False,
    )
    assert answer.content == "It said: echo: hi." and rounds.state(answer).step == "done"

    first, second = scripted.requests
    before = tuple(first.prompt_ids) + tuple(step.token_ids)
    assert tuple(second.prompt_ids[: len(before)]) == before  # token-exact extension
    m = answer.meta
    assert m["cached_tokens"] >= len(before)
    assert m["prefill_tokens"] == m["prompt_tokens"] - m["cached_tokens"]
    tail = scripted.engine.tokenizer.decode(list(second.prompt_ids[len(before) :]))
    assert "echo: hi" in tail and tail.rstrip().endswith("assistant|>")  # result + gen prompt


def test_regenerating_the_step_after_a_result_restores_up_to_the_result(chat):
    scripted, session, rounds, _ = chat
    scripted.replies += [call_text("echo", '{"text": "x"}'), "First answer.", "Second answer."]
    state = rounds.state(finished(session.send("Echo x.")))
    rounds.resolve(state, lambda c: Decision("once"))
    answer_turn = rounds.next_round(state)
    answer = finished(answer_turn)
    up_to_result = answer_turn.prompt.boundaries[-1][0]  # the tool message's end

    again = finished(rounds.regenerate_step(answer.id))
    assert again.parent_id == answer.parent_id and again.content == "Second answer."
    assert session.active_path()[-1].id == again.id
    assert again.meta["cached_tokens"] >= up_to_result
    assert again.meta["prefill_tokens"] <= answer.meta["prompt_tokens"] - up_to_result
    siblings = session.store.replies(answer.parent_id)
    assert [n.id for n in siblings] == [answer.id, again.id]


def test_bad_calls_get_error_results_and_the_conversation_goes_on(chat):
    scripted, session, rounds, host = chat
    scripted.replies += [
        call_text("write_file", '{"path": "a"}'),
        call_text("echo", '{"text": '),
        "I could not use the tools.",
    ]
    step = finished(session.send("Try."))
    state = rounds.state(step)
    assert rounds.resolve(state, lambda c: pytest.fail("nothing to approve"))
    unknown = session.active_path()[-1]
    assert unknown.meta["is_error"] and "no tool named 'write_file'" in unknown.content
    assert "echo" in unknown.content  # the tools there are

    step = finished(rounds.next_round(state))
    assert step.meta["tool_call_errors"]  # the unreadable call
    state = rounds.state(step)
    rounds.resolve(state, lambda c: pytest.fail("nothing to approve"))
    bad = session.active_path()[-1]
    assert bad.meta["is_error"] and "JSON object" in bad.content
    final = finished(rounds.next_round(state))
    assert final.content == "I could not use the tools."
    assert host.calls == []
    roles = [n.role for n in session.active_path()]
    assert roles == ["user", "assistant", "tool", "assistant", "tool", "assistant"]


def test_deny_with_a_reason_always_allow_and_a_cancelled_call(chat):
    scripted, session, rounds, host = chat
    echo = call_text("echo", '{"text": "a"}')
    scripted.replies += [echo, echo, echo, echo, "Done."]
    cid = session.new_conversation()

    state = rounds.state(finished(session.send("Go.", conversation_id=cid)))
    rounds.resolve(state, lambda c: Decision("deny", "not now"))
    denied = session.active_path()[-1]
    assert denied.meta["denied"] and denied.content == "the user denied this call: not now"

    state = rounds.state(finished(rounds.next_round(state)))
    host.cancel_next = True
    rounds.resolve(state, lambda c: Decision("always"))
    cancelled = session.active_path()[-1]
    assert cancelled.meta["cancelled"] and cancelled.meta["is_error"]
    assert session.settings(cid).allowed_tools == ("kit.echo",)

    state = rounds.state(finished(rounds.next_round(state)))
    assert not rounds.needs_approval(state.calls[0], cid)
    rounds.resolve(state, lambda c: pytest.fail("allowed for the conversation"))
    assert session.active_path()[-1].content == "echo: a"

    # the fourth step with calls is past max_rounds=3: its call is answered "not run"
    state = rounds.state(finished(rounds.next_round(state)))
    assert state.step == "limit" and state.rounds == 4
    assert not rounds.resolve(state, lambda c: pytest.fail("not asked"))
    assert "limit of 3 tool rounds" in session.active_path()[-1].content
    assert len(host.calls) == 2


def test_the_prompt_carries_the_tools_and_the_round_messages(chat):
    scripted, session, rounds, _ = chat
    scripted.replies += [call_text("echo", '{"text": "q"}'), "ok"]
    state = rounds.state(finished(session.send("Q?")))
    rounds.resolve(state, lambda c: Decision("once"))
    finished(rounds.next_round(state))
    messages = session.prompt_messages(session.active_path())
    assert messages[1]["tool_calls"][0]["function"]["name"] == "echo"
    assert (messages[2]["role"], messages[2]["tool_call_id"], messages[2]["name"]) == (
        "tool",
        messages[1]["tool_calls"][0]["id"],
        "echo",
    )
    text = scripted.engine.tokenizer.decode(list(scripted.requests[0].prompt_ids))
    assert json.dumps(ECHO.description)[1:-1] in text  # the template rendered the tools


BARE = '{"name": "echo", "arguments": {"text": "hi"}}'


@pytest.mark.parametrize("written", [BARE, f"```json\n{BARE}\n```"], ids=["bare", "fenced"])
def test_a_bare_call_is_rendered_as_written_so_the_next_round_restores_the_reply(chat, written):
    # demo (Qwen2.5-Coder-0.5B) often writes its call without <tool_call> markers; the
    # template would render the stored call with them, so the prompt would leave the
    # generated ids at the reply's start and the cache would miss from there
    scripted, session, rounds, _ = chat
    scripted.replies.append(written)  # the next step is sampled greedily
    step = finished(session.send("Say hi through echo."))
    assert step.meta["tool_calls"][0]["function"]["name"] == "echo"
    assert step.meta["as_written"] == written and step.content == ""
    state = rounds.state(step)
    assert rounds.resolve(state, lambda c: Decision("once"))
    turn = rounds.next_round(state, max_tokens=8)
    hot = turn.wait(120)
    assert turn.reply_node is not None, turn.error

    first, second = scripted.requests
    before = tuple(first.prompt_ids) + tuple(step.token_ids)
    assert tuple(second.prompt_ids[: len(before)]) == before  # the reply as generated
    m = hot.metrics
    assert m.cached_tokens >= len(before)
    assert m.prefill_tokens == m.prompt_tokens - m.cached_tokens
    tail = scripted.engine.tokenizer.decode(list(second.prompt_ids[len(before) :]))
    # prefilled: the reply's end, the result and the generation prompt; none of the call
    assert '"name"' not in tail and "```" not in tail
    assert "echo: hi" in tail and tail.rstrip().endswith("assistant|>")

    engine = scripted.engine
    cold = engine.submit(GenerateRequest(second.prompt_ids, second.sampling, use_cache=False))
    assert_same(cold.wait(120), cold, hot, turn.request_handle)


def test_a_bare_call_from_another_model_is_rendered_as_its_call(chat):
    scripted, session, rounds, _ = chat
    scripted.replies += [BARE, "ok"]
    step = finished(session.send("Echo."))
    rounds.resolve(rounds.state(step), lambda c: Decision("once"))
    step = session.store.get_node(step.id)
    mine = session.prompt_messages(session.active_path())
    assert mine[1]["content"] == BARE and "tool_calls" not in mine[1]
    session.store.replace_reply(step.id, step.content, step.token_ids, {**step.meta, "model": "x"})
    other = session.prompt_messages(session.active_path())
    assert other[1]["content"] == "" and other[1]["token_ids"] is None
    assert other[1]["tool_calls"] == step.meta["tool_calls"]


def test_continuing_a_reply_cut_inside_a_call_runs_the_round(chat):
    scripted, session, rounds, host = chat
    whole = call_text("echo", '{"text": "cut"}')
    cut_at = whole.index('"arguments"') + 5
    scripted.replies += [whole[:cut_at], whole[cut_at:], "It said: echo: cut."]
    step = finished(session.send("Echo cut."))
    assert step.meta["finish_reason"] == "length"
    assert "tool_calls" not in step.meta  # cut inside the call: no call (and no error) yet
    assert step.content == whole[:cut_at] and rounds.state(step).step == "done"

    grown = finished(session.continue_reply(step.id))
    assert grown.id == step.id and grown.meta["continued"] == 1
    (call,) = grown.meta["tool_calls"]  # the whole reply read, not the continued part
    assert call["function"] == {"name": "echo", "arguments": '{"text": "cut"}'}
    assert grown.content == ""
    state = rounds.state(grown)
    assert state.step == "run" and rounds.resolve(state, lambda c: Decision("once"))
    assert host.calls == [("kit.echo", {"text": "cut"})]
    answer = finished(rounds.next_round(state))
    assert answer.content == "It said: echo: cut."
