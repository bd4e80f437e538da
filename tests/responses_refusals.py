"""Responses API parameters this server honours only at their neutral value, each with a value it refuses: the unit
tests send them to the request model, the server tests over HTTP, and both expect a 400 naming the parameter."""

from __future__ import annotations

NOT_NEUTRAL = [
    # (fields beyond model and input, param)
    ({"background": True}, "background"),
    ({"store": True}, "store"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"conversation": "conv_1"}, "conversation"),
]
