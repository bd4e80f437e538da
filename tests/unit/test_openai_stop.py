"""How the OpenAI frontend ends a Triton request whose client went away (frontend/openai/triton_bridge.py): a post on
the server's stop board, the stream read to its end in the background; a gRPC cancel (which can crash Triton 2.51)
only where the server has no board this process can see. A fake call stands in for tritonclient's stream."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from backend.contract.stop_board import StopBoard
from frontend.openai import triton_bridge
from frontend.openai.triton_bridge import BackgroundTasks, TritonGeneration


class FakeResult:
    def __init__(self, reason: str = "") -> None:
        self.outputs = {"text_output": np.array([b"x"], dtype=object), "output_ids": np.array([1], dtype=np.int32),
                        "finish_reason": np.array([reason.encode()], dtype=object) if reason else None}

    def as_numpy(self, name):
        return self.outputs.get(name)


class FakeCall:
    """A stream whose responses the test releases one at a time; ``cancelled`` says whether it was cancelled."""

    def __init__(self) -> None:
        self.responses: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.ended = False

    async def __anext__(self):
        try:
            item = await self.responses.get()
        except asyncio.CancelledError:
            self.cancelled = True  # what grpc.aio does when the task reading a call is cancelled
            raise
        if item is None:
            self.ended = True
            raise StopAsyncIteration
        return item, None

    def __aiter__(self):
        return self

    def cancel(self):
        self.cancelled = True


@pytest.fixture
def board(tmp_path, monkeypatch):
    board = StopBoard(tmp_path / "board").clear()
    monkeypatch.setattr(triton_bridge.StopBoard, "find", staticmethod(lambda url: board))
    return board


def test_a_generation_whose_reader_is_cancelled_is_posted_and_read_to_its_end_not_cancelled(board):
    async def scenario():
        call, background = FakeCall(), BackgroundTasks()
        generation = TritonGeneration(call, "prompt", "127.0.0.1:1", request_id="openai-1", background=background)
        call.responses.put_nowait(FakeResult())
        assert (await generation.__anext__()).text == "x"
        reader = asyncio.ensure_future(generation.__anext__())  # waits for the next token
        await asyncio.sleep(0.01)
        reader.cancel()  # the client went away: its handler's task is cancelled
        with pytest.raises(asyncio.CancelledError):
            await reader
        await generation.aclose()
        assert board.posted() == {"openai-1"} and not call.cancelled and len(background) == 1
        call.responses.put_nowait(FakeResult("abort"))  # the model's final response to the stopped request
        call.responses.put_nowait(None)  # and Triton closes the stream
        await background.close(timeout=5)
        assert call.ended and not call.cancelled and board.posted() == frozenset()

    asyncio.run(scenario())


def test_without_a_board_the_stream_is_cancelled(monkeypatch):
    monkeypatch.setattr(triton_bridge.StopBoard, "find", staticmethod(lambda url: None))

    async def scenario():
        call = FakeCall()
        generation = TritonGeneration(call, "prompt", "10.0.0.1:1", request_id="openai-2")
        await generation.aclose()
        assert call.cancelled

    asyncio.run(scenario())


def test_a_stop_the_server_never_takes_ends_in_a_cancel_after_the_bound(board, monkeypatch):
    monkeypatch.setattr(triton_bridge, "STOP_TIMEOUT_S", 0.05)

    async def scenario():
        call, background = FakeCall(), BackgroundTasks()
        generation = TritonGeneration(call, "prompt", "127.0.0.1:1", request_id="openai-3", background=background)
        await generation.aclose()
        await background.close(timeout=5)
        assert call.cancelled and board.posted() == frozenset()

    asyncio.run(scenario())


def test_a_finished_generation_is_read_to_its_end_and_nothing_is_posted(board):
    async def scenario():
        call, background = FakeCall(), BackgroundTasks()
        generation = TritonGeneration(call, "prompt", "127.0.0.1:1", request_id="openai-4", background=background)
        call.responses.put_nowait(FakeResult("length"))
        assert (await generation.__anext__()).finish_reason == "length" and generation.finished
        await generation.aclose()
        await generation.aclose()  # twice: once
        assert board.posted() == frozenset()
        call.responses.put_nowait(None)
        await background.close(timeout=5)
        assert call.ended and not call.cancelled

    asyncio.run(scenario())
