"""Responses: what one engine output means for a Triton request (a streamed delta, or the whole text at the end),
and error responses. Every request gets exactly one response flagged final."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backend.engine.llm_engine import RequestOutput


@dataclass
class OpenRequest:
    """A request the server has accepted and not yet answered finally. Used only by the thread that sends."""

    sender: Any
    stream: bool
    arrival: float = field(default_factory=time.perf_counter)
    omitted_outputs: frozenset[str] = frozenset()
    text: list[str] = field(default_factory=list)  # non-streaming: the whole text, sent at the end
    token_ids: list[int] = field(default_factory=list)


def send_output(pb, open_request: OpenRequest, output: RequestOutput, batched: bool) -> None:
    """Send what one engine output means for this request: a delta (streaming), or the whole text at the end."""
    flags = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if output.finished else 0
    if output.error is not None:
        open_request.sender.send(pb.InferenceResponse(output_tensors=[], error=pb.TritonError(output.error)), flags=flags)
        return
    if open_request.stream:
        text, token_ids = output.text, output.token_ids
    else:
        open_request.text.append(output.text)
        open_request.token_ids += output.token_ids
        if not output.finished:
            return
        text, token_ids = "".join(open_request.text), open_request.token_ids
    tensors = make_output_tensors(pb, text, token_ids, output, batched, open_request.omitted_outputs)
    open_request.sender.send(pb.InferenceResponse(output_tensors=tensors), flags=flags)


def make_output_tensors(
    pb, text: str, token_ids: list[int], output: RequestOutput, batched: bool, omitted: frozenset[str] = frozenset()
) -> list:
    lead = (1,) if batched else ()  # a model with max_batch_size > 0 answers with a batch dimension
    reason = output.finish_reason if output.finished else ""
    arrays = {
        "text_output": np.array([text.encode("utf-8")], dtype=np.object_),
        "output_ids": np.array(token_ids, dtype=np.int32),
        "finish_reason": np.array([(reason or "").encode()], dtype=np.object_),
        "num_input_tokens": np.array([output.num_prompt_tokens], dtype=np.int32),
        "num_output_tokens": np.array([output.num_output_tokens], dtype=np.int32),
    }
    return [pb.Tensor(name, array.reshape(lead + (-1,))) for name, array in arrays.items() if name not in omitted]


# NOTE: error responses carry Triton's default code: a decoupled model's errors reach clients as text only (gRPC
# stream error_message; HTTP /generate answers 400 to every model error in 2.51), so the message says it all.
def send_error(pb, sender, message: str) -> None:
    sender.send(
        pb.InferenceResponse(output_tensors=[], error=pb.TritonError(message)),
        flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
    )
