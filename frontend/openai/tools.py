"""OpenAI's ``tools`` for chat: the tools a request offers, the JSON its ``tool_choice`` makes the model write (a
schema that the engine's structured output holds the answer to, so it can never be broken JSON), the tool list for
chat templates that do not take tools, and the answer parsed back into tool calls.

What the model writes, by ``tool_choice`` (the shapes of vLLM's "required" and of llama.cpp's generic tool format):

    {"type": "function", ...}  the named function's arguments: its ``parameters`` schema
    "required"                 [{"name": <a tool>, "arguments": {...}}, ...]: 1 to N calls (1 without parallel calls)
    "auto" (with tools)        {"tool_calls": [...as for required...]} or {"content": "<text>"}
    "none"                     plain text; the tools are not offered
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from openai.types.chat import ChatCompletionMessage, ChatCompletionMessageFunctionToolCall
from openai.types.chat.chat_completion_chunk import ChoiceDelta, ChoiceDeltaToolCall, ChoiceDeltaToolCallFunction
from openai.types.chat.chat_completion_message_function_tool_call import Function

from frontend.openai.protocol import ChatMessage, bad_request

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
FUNCTION_KEYS = ("name", "description", "parameters", "strict")
ANY_OBJECT = {"type": "object"}  # the arguments of a function that sends no parameters


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def definition(self) -> dict[str, Any]:
        """OpenAI's form, which is also what transformers' ``apply_chat_template(tools=...)`` takes."""
        described = {"description": self.description} if self.description else {}
        return {"type": "function", "function": {"name": self.name, **described, "parameters": self.parameters}}


@dataclass(frozen=True)
class Reply:
    """An answer as the client gets it: text, or tool calls as (name, arguments as JSON text)."""

    content: str | None
    calls: tuple[tuple[str, str], ...]
    finish_reason: str

    def message(self) -> ChatCompletionMessage:
        if not self.calls:
            return ChatCompletionMessage(role="assistant", content=self.content)
        calls = [ChatCompletionMessageFunctionToolCall(id=call_id(), type="function",
                                                       function=Function(name=name, arguments=arguments))
                 for name, arguments in self.calls]
        return ChatCompletionMessage(role="assistant", content=None, tool_calls=calls)

    def delta(self) -> ChoiceDelta:
        """The whole answer in one streamed delta (the SDK's stream helpers assemble tool calls from it)."""
        if not self.calls:
            return ChoiceDelta(content=self.content)
        calls = [ChoiceDeltaToolCall(index=i, id=call_id(), type="function",
                                     function=ChoiceDeltaToolCallFunction(name=name, arguments=arguments))
                 for i, (name, arguments) in enumerate(self.calls)]
        return ChoiceDelta(tool_calls=calls)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCalling:
    """What ``tools``, ``tool_choice`` and ``parallel_tool_calls`` ask of an answer."""

    tools: tuple[Tool, ...]
    choice: Literal["auto", "required", "function"]
    function: Tool | None  # the named one (choice "function")
    parallel: bool

    @classmethod
    def of(cls, tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolCalling | None:
        """The request's tool calling, None where no tool may be called; a 400 naming what is wrong."""
        offered = parse_tools(tools)
        if tool_choice is None:
            tool_choice = "auto" if offered else "none"  # OpenAI's default
        if tool_choice == "none":
            return None
        if not offered:
            raise bad_request(f"tool_choice {tool_choice!r} needs tools: send the functions the model may call",
                              param="tool_choice")
        parallel = parallel_tool_calls is not False
        if tool_choice in ("auto", "required"):
            return cls(offered, tool_choice, None, parallel)
        name = _named_function(tool_choice)
        function = next((tool for tool in offered if tool.name == name), None)
        if function is None:
            raise bad_request(f"tool_choice names the function {name!r}, which is not among tools "
                              f"({', '.join(tool.name for tool in offered)})", param="tool_choice")
        return cls(offered, "function", function, parallel)

    def structured_output(self) -> dict[str, Any]:
        """The engine's ``structured_outputs`` for the answer."""
        return {"json": self.schema()}

    def schema(self) -> dict[str, Any]:
        if self.function is not None:
            return self.function.parameters
        calls, defs = self._calls_schema()
        if self.choice == "required":
            return {**calls, "$defs": defs}
        return {"anyOf": [_closed_object("tool_calls", calls), _closed_object("content", {"type": "string"})],
                "$defs": defs}

    def _calls_schema(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """A JSON array of calls, each ``{"name": <a tool>, "arguments": <its parameters>}``; each tool's
        parameters (and their own ``$defs``) go in the root's ``$defs``, under the tool's name."""
        defs: dict[str, Any] = {}
        items = []
        for tool in self.tools:
            defs.update(_hoisted(tool.parameters, tool.name))
            items.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                          "properties": {"name": {"const": tool.name},
                                         "arguments": {"$ref": f"#/$defs/{tool.name}"}}})
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            calls["maxItems"] = 1
        return calls, defs

    def system_prompt(self) -> str:
        """The tools and the reply's format, for a chat template that does not take tools."""
        listed = json.dumps([tool.definition()["function"] for tool in self.tools], ensure_ascii=False)
        call = '{"name": <function name>, "arguments": {<its arguments>}}'
        if self.function is not None:
            ask = f"Call the function {self.function.name}: reply with its arguments only, as one JSON object."
        elif self.choice == "required":
            ask = (f"Reply with a JSON array of the calls to make, each {call}"
                   f"{'' if self.parallel else ', one call only'}.")
        else:
            ask = (f'Reply with one JSON object: {{"tool_calls": [{call}]}} to call functions'
                   f'{"" if self.parallel else " (one call at most)"}, or {{"content": <your answer as text>}} to '
                   "answer without them.")
        return (f"You can call these functions (their arguments as JSON schemas):\n{listed}\n{ask} "
                'Results of calls come back in "tool" messages.')

    def reply(self, text: str, finish_reason: str) -> Reply:
        """The model's ``text`` as tool calls (finish reason ``tool_calls``) or content. Text that does not parse (an
        answer cut by ``max_tokens`` or a stop string) is returned as content with its finish reason."""
        try:
            value = json.loads(text)
        except ValueError:
            return Reply(text, (), finish_reason)
        if self.function is not None:
            calls = [{"name": self.function.name, "arguments": value}]
        elif self.choice == "required":
            calls = value
        elif isinstance(value, dict) and isinstance(value.get("content"), str) and len(value) == 1:
            return Reply(value["content"], (), finish_reason)
        else:
            calls = value.get("tool_calls") if isinstance(value, dict) else None
        names = {tool.name for tool in self.tools}
        if (not isinstance(calls, list) or not calls
                or not all(isinstance(c, dict) and c.get("name") in names and isinstance(c.get("arguments"), dict)
                           for c in calls)):
            return Reply(text, (), finish_reason)  # NOTE: not what the grammar allows: a stop string cut it
        return Reply(None, tuple((c["name"], _json(c["arguments"])) for c in calls), "tool_calls")


def parse_tools(tools: list[Any] | None) -> tuple[Tool, ...]:
    """``tools`` as sent, checked: a 400 naming the entry's field as the client sent it (``tools.0.function.name``)."""
    parsed: list[Tool] = []
    for i, entry in enumerate(tools or ()):
        where = f"tools.{i}"
        if not isinstance(entry, dict) or entry.get("type") != "function":
            raise bad_request(f"{where}.type must be 'function' (the only kind of tool this server calls)",
                              param=f"{where}.type")
        unknown = sorted(set(entry) - {"type", "function"})
        if unknown:
            raise bad_request(f"Unrecognized request argument supplied: {where}.{unknown[0]}",
                              param=f"{where}.{unknown[0]}", code="unsupported_parameter")
        function = entry.get("function")
        if not isinstance(function, dict):
            raise bad_request(f"{where}.function must be an object with the function's name",
                              param=f"{where}.function")
        unknown = sorted(set(function) - set(FUNCTION_KEYS))
        if unknown:
            raise bad_request(f"Unrecognized request argument supplied: {where}.function.{unknown[0]}",
                              param=f"{where}.function.{unknown[0]}", code="unsupported_parameter")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise bad_request(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-'; got {name!r}",
                              param=f"{where}.function.name")
        if any(tool.name == name for tool in parsed):
            raise bad_request(f"{where}.function.name: {name!r} is the name of an earlier tool too",
                              param=f"{where}.function.name")
        description, parameters = function.get("description"), function.get("parameters")
        if description is not None and not isinstance(description, str):
            raise bad_request(f"{where}.function.description must be a string", param=f"{where}.function.description")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(f"{where}.function.parameters must be a JSON schema (an object)",
                              param=f"{where}.function.parameters")
        if function.get("strict") not in (None, True, False):
            raise bad_request(f"{where}.function.strict must be true or false", param=f"{where}.function.strict")
        parsed.append(Tool(name, description, parameters or ANY_OBJECT))
    return tuple(parsed)


def _named_function(tool_choice: Any) -> str:
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
    raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"function\": "
                      f"{{\"name\": ...}}}}; got {tool_choice!r}", param="tool_choice")


def _closed_object(key: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "required": [key], "properties": {key: schema}}


def _hoisted(parameters: dict[str, Any], name: str) -> dict[str, Any]:
    """``parameters`` as ``$defs`` entries of a larger schema: itself under ``name``, its own ``$defs`` (or
    ``definitions``) under ``name.<def>``, every local ``$ref`` pointed at the new place."""
    schema = copy.deepcopy(parameters)
    inner = {**schema.pop("definitions", {}), **schema.pop("$defs", {})}
    hoisted = {name: schema, **{f"{name}.{key}": value for key, value in inner.items()}}

    def moved(ref: str) -> str:
        for prefix in ("#/$defs/", "#/definitions/"):
            if ref.startswith(prefix):
                return f"#/$defs/{name}." + ref[len(prefix):]
        return f"#/$defs/{name}" + ref[1:] if ref.startswith("#") else ref

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "$ref" and isinstance(value, str):
                    node[key] = moved(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(hoisted)
    return hoisted


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# ---- messages with tool calls and tool results, as chat templates take them ---------------------------------------


def template_turn(message: ChatMessage, index: int, native: bool) -> dict[str, Any]:
    """A tool result or an assistant's tool calls as a turn of the template: in transformers' form (``native``, a
    template that takes tools: arguments as a dict), or as the text the model writes (``{"tool_calls": [...]}``)
    beside the tool results as ``tool`` turns."""
    text = message.text()
    if message.role == "tool":
        turn = {"role": "tool", "content": text}
        if native:
            turn["tool_call_id"] = message.tool_call_id
        return turn
    calls = [(call.function.name, _arguments(call.function.arguments, f"messages.{index}.tool_calls.{i}"))
             for i, call in enumerate(message.tool_calls or ())]
    if native:
        return {"role": "assistant", "content": text,
                "tool_calls": [{"id": call.id, "type": "function", "function": {"name": name, "arguments": args}}
                               for call, (name, args) in zip(message.tool_calls, calls)]}
    written = _json({"tool_calls": [{"name": name, "arguments": args} for name, args in calls]})
    return {"role": "assistant", "content": f"{text}\n{written}" if text else written}


def _arguments(arguments: str, where: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError as exc:
        raise bad_request(f"{where}.function.arguments is not JSON: {exc}", param=f"{where}.function.arguments") \
            from None


def with_system_text(turns: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """``turns`` with ``text`` at the end of the first system turn, or in a system turn of its own before them."""
    if turns and turns[0]["role"] == "system":
        first = turns[0]["content"]
        return [{**turns[0], "content": f"{first}\n\n{text}" if first else text}, *turns[1:]]
    return [{"role": "system", "content": text}, *turns]
