"""OpenAI tools without a server (frontend/openai/tools.py): the checks of tools and tool_choice, the schema each
tool_choice holds the answer to (compiled by llguidance, as the engine compiles it, and tried on texts), the prompt
of a template without tools and of one with them, and answers parsed back into tool calls, cut ones included."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, ConfigDict, Field

from backend.engine.structured_output import StructuredOutputsParams
from frontend.openai.chat_template import ChatTemplate
from frontend.openai.protocol import APIError, ChatCompletionRequest


class Point(BaseModel):
    model_config = ConfigDict(extra="forbid")
    x: int = Field(ge=0, le=9)
    y: int = Field(ge=0, le=9)


class Move(BaseModel):
    """A nested model: its schema has ``$defs`` and a ``$ref`` to them."""

    model_config = ConfigDict(extra="forbid")
    to: Point
    fast: bool


def function(name: str, parameters: dict | None = None, **more) -> dict:
    body = {"name": name, **more}
    if parameters is not None:
        body["parameters"] = parameters
    return {"type": "function", "function": body}


WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 12}}}
TOOLS = [function("get_weather", WEATHER, description="The weather of a city"),
         function("move", Move.model_json_schema())]
USER = [{"role": "user", "content": "Weather in Paris?"}]
HISTORY = [*USER,
           {"role": "assistant", "content": None,
            "tool_calls": [{"id": "call_1", "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]


def request(**fields) -> ChatCompletionRequest:
    chat = ChatCompletionRequest(**{"model": "m", "messages": USER, **fields})
    chat.check_supported()
    return chat


def refused(**fields) -> APIError:
    with pytest.raises(APIError) as error:
        request(**fields)
    assert error.value.status == 400
    return error.value


@pytest.fixture(scope="module")
def template(smollm2_dir):
    return ChatTemplate(smollm2_dir)


@pytest.fixture(scope="module")
def llg_tokenizer(template):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(template.tokenizer)


def accepts(llg_tokenizer, template, schema: dict, text: str) -> bool:
    """Whether the grammar the engine compiles from ``schema`` takes ``text`` whole."""
    from llguidance import LLMatcher

    grammar = StructuredOutputsParams(json=schema).grammar_text()
    assert not LLMatcher.validate_grammar_with_warnings(grammar, llg_tokenizer)[0]
    matcher = LLMatcher(llg_tokenizer, grammar, log_level=0)
    return matcher.consume_tokens(template.tokenizer.encode(text)) and matcher.is_accepting()


# ---- what a request may send ------------------------------------------------------------------------------------


def test_tool_choice_defaults_to_auto_with_tools_and_none_offers_nothing():
    assert request(tools=TOOLS).tool_calling.choice == "auto"
    assert request(tools=TOOLS).tool_calling.parallel
    assert request(tools=TOOLS, parallel_tool_calls=False).tool_calling.parallel is False
    plain = request(tools=TOOLS, tool_choice="none")
    assert plain.tool_calling is None and plain.structured_output() is None
    assert request().tool_calling is None and request(tool_choice="none").tool_calling is None
    named = request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "move"}}).tool_calling
    assert (named.choice, named.function.name) == ("function", "move")
    assert request(tools=[function("f")], tool_choice="required").tool_calling.tools[0].parameters == \
        {"type": "object"}


@pytest.mark.parametrize("fields, param, says", [
    ({"tools": [function("")]}, "tools.0.function.name", "1 to 64"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name", "None"),
    ({"tools": [TOOLS[0], function("a b")]}, "tools.1.function.name", "'a b'"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools.1.function.name", "earlier tool"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools.0.type", "'function'"),
    ({"tools": [{"type": "function"}]}, "tools.0.function", "an object"),
    ({"tools": [function("f", ["x"])]}, "tools.0.function.parameters", "JSON schema"),
    ({"tools": [function("f", description=3)]}, "tools.0.function.description", "a string"),
    ({"tools": [function("f", strict="yes")]}, "tools.0.function.strict", "true or false"),
    ({"tools": [function("f", examples=[])]}, "tools.0.function.examples", "Unrecognized"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not among tools (get_weather, move)"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "'none', 'auto', 'required'"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools"}}, "tool_choice", "got"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "logprobs": True}, "logprobs", "cannot be combined with tool calls"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "send one of"),
])
def test_bad_tools_are_a_400_naming_the_parameter_as_sent(fields, param, says):
    error = refused(**fields)
    assert error.param == param and says in error.message, (error.param, error.message)


def test_tool_turns_are_checked_as_messages():
    with pytest.raises(ValueError, match="tool_call_id"):
        ChatCompletionRequest(model="m", messages=[{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="content is required"):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": None}])
    with pytest.raises(ValueError, match="assistant turns"):
        ChatCompletionRequest(model="m", messages=[{**HISTORY[1], "role": "user", "content": "x"}])
    assert request(messages=HISTORY).messages[1].text() == ""
    assert request(messages=HISTORY, tool_choice="none").tool_calling is None  # a history needs no tools


# ---- the schema of each tool_choice ---------------------------------------------------------------------------------


def test_a_named_function_is_held_to_its_parameters(template, llg_tokenizer):
    calling = request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "move"}}).tool_calling
    schema = calling.schema()
    assert schema == Move.model_json_schema() and calling.structured_output() == {"json": schema}
    assert accepts(llg_tokenizer, template, schema, '{"to": {"x": 1, "y": 2}, "fast": true}')
    assert not accepts(llg_tokenizer, template, schema, '{"to": {"x": 10, "y": 2}, "fast": true}')


def test_required_is_an_array_of_calls_each_held_to_its_tools_parameters(template, llg_tokenizer):
    schema = request(tools=TOOLS, tool_choice="required").tool_calling.schema()
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert set(schema["$defs"]) == {"get_weather", "move", "move.Point"}  # the nested model's $defs hoisted
    two = ('[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
           '{"name": "move", "arguments": {"to": {"x": 1, "y": 2}, "fast": false}}]')
    assert accepts(llg_tokenizer, template, schema, two)
    assert not accepts(llg_tokenizer, template, schema, "[]")
    assert not accepts(llg_tokenizer, template, schema, '[{"name": "move", "arguments": {"city": "Paris"}}]')
    assert not accepts(llg_tokenizer, template, schema, '[{"name": "other", "arguments": {}}]')
    single = request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).tool_calling.schema()
    assert single["maxItems"] == 1 and not accepts(llg_tokenizer, template, single, two)
    assert accepts(llg_tokenizer, template, single, '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]')


def test_auto_is_tool_calls_or_content(template, llg_tokenizer):
    schema = request(tools=TOOLS).tool_calling.schema()
    for text in ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}',
                 '{"content": "I cannot tell."}'):
        assert accepts(llg_tokenizer, template, schema, text), text
    for text in ('{"content": "x", "tool_calls": []}', '{"tool_calls": []}', '"just text"', 'Sunny.'):
        assert not accepts(llg_tokenizer, template, schema, text), text


# ---- the prompt -----------------------------------------------------------------------------------------------------


def test_a_template_without_tools_gets_them_in_the_system_turn(template):
    assert not template.takes_tools  # SmolLM2's
    chat = request(tools=TOOLS)
    rendered = template.render(chat.messages, chat.tool_calling)
    assert rendered.startswith("<|im_start|>system\nYou can call these functions")
    assert '"name": "get_weather", "description": "The weather of a city"' in rendered
    assert '{"content": <your answer as text>}' in rendered and "SmolLM" not in rendered
    terse = request(messages=[{"role": "system", "content": "Be terse."}, *USER], tools=TOOLS,
                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    rendered = template.render(terse.messages, terse.tool_calling)
    assert rendered.startswith("<|im_start|>system\nBe terse.\n\nYou can call these functions")
    assert "Call the function get_weather: reply with its arguments only" in rendered
    assert rendered.count("<|im_start|>system") == 1
    none = request(tools=TOOLS, tool_choice="none")
    assert template.render(none.messages, none.tool_calling) == template.render(request().messages)


def test_a_history_of_calls_and_results_renders_as_the_model_writes_them(template):
    chat = request(messages=HISTORY, tools=TOOLS)
    rendered = template.render(chat.messages, chat.tool_calling)
    assert ('<|im_start|>assistant\n{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'
            '<|im_end|>\n<|im_start|>tool\nsunny, 21 C<|im_end|>\n<|im_start|>assistant\n') in rendered
    bad = [HISTORY[0], {**HISTORY[1], "tool_calls": [{**HISTORY[1]["tool_calls"][0],
                                                      "function": {"name": "get_weather", "arguments": "{city"}}]}]
    with pytest.raises(APIError) as error:
        template.render(request(messages=bad).messages)
    assert error.value.param == "messages.1.tool_calls.0.function.arguments"


def test_a_template_with_tools_takes_them_in_transformers_form(smollm2_dir):
    native = ChatTemplate(smollm2_dir)
    native.tokenizer.chat_template = (
        "{% for t in tools or [] %}TOOL {{ t.function.name }}; {% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.id }} {{ c.function.name }} {{ c.function.arguments.city }}"
        "{% endfor %}{% if m.tool_call_id %} (for {{ m.tool_call_id }}){% endif %}; {% endfor %}")
    assert native.takes_tools
    chat = request(messages=HISTORY, tools=TOOLS)
    assert native.render(chat.messages, chat.tool_calling) == (
        "TOOL get_weather; TOOL move; user: Weather in Paris?; assistant: CALL call_1 get_weather Paris; "
        "tool: sunny, 21 C (for call_1); ")


def test_a_template_that_cannot_render_tool_turns_is_a_400_that_says_so(smollm2_dir):
    strict = ChatTemplate(smollm2_dir)
    strict.tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('unknown role ' + m.role) }}{% endif %}{{ m.content }}{% endfor %}")
    with pytest.raises(APIError) as error:
        strict.render(request(messages=HISTORY).messages)
    assert error.value.param == "messages"
    assert "cannot render tool messages: unknown role tool" in error.value.message


# ---- answers parsed back ----------------------------------------------------------------------------------------


def test_answers_become_tool_calls_or_content():
    named = request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}).tool_calling
    reply = named.reply('{ "city" :\n "Paris"}', "stop")
    assert (reply.content, reply.calls, reply.finish_reason) == (None, (("get_weather", '{"city": "Paris"}'),),
                                                                  "tool_calls")
    message = reply.message()
    assert message.content is None and message.tool_calls[0].id.startswith("call_")
    assert message.tool_calls[0].type == "function" and message.tool_calls[0].function.name == "get_weather"
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris"}
    delta = reply.delta()
    assert delta.tool_calls[0].index == 0 and delta.tool_calls[0].function.arguments == '{"city": "Paris"}'

    required = request(tools=TOOLS, tool_choice="required").tool_calling
    two = required.reply('[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                         '{"name": "move", "arguments": {"to": {"x": 1, "y": 2}, "fast": true}}]', "stop")
    assert [name for name, _ in two.calls] == ["get_weather", "move"] and two.finish_reason == "tool_calls"
    assert [c.index for c in two.delta().tool_calls] == [0, 1]

    auto = request(tools=TOOLS).tool_calling
    text = auto.reply('{"content": "Sunny."}', "stop")
    assert (text.content, text.calls, text.finish_reason) == ("Sunny.", (), "stop")
    assert text.message().tool_calls is None and text.delta().content == "Sunny."
    call = auto.reply('{"tool_calls": [{"name": "move", "arguments": {"to": {"x": 0, "y": 0}, "fast": false}}]}',
                      "stop")
    assert call.calls[0][0] == "move" and call.finish_reason == "tool_calls"


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("text, finish_reason", [
    ('{"tool_calls": [{"name": "get_weather", "arguments": {"ci', "length"),
    ('[{"name": "get_wea', "length"),
    ('{"city": "Par', "length"),
    ("", "length"),
    ('{"tool_calls": [{"name": "get_weather"', "stop"),  # a stop string cut it
])
def test_a_cut_answer_is_its_text_with_its_finish_reason(choice, text, finish_reason):
    reply = request(tools=TOOLS, tool_choice=choice).tool_calling.reply(text, finish_reason)
    assert (reply.content, reply.calls, reply.finish_reason) == (text, (), finish_reason)
    assert reply.message().content == text


def test_json_of_another_shape_is_content_not_a_call():
    auto = request(tools=TOOLS).tool_calling
    for text in ('{"tool_calls": [{"name": "unknown", "arguments": {}}]}', '[1, 2]', '{"content": 3}', "[]"):
        assert auto.reply(text, "stop").content == text
    assert request(tools=TOOLS, tool_choice="required").tool_calling.reply("[]", "stop").calls == ()
