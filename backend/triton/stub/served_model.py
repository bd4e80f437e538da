"""What every served model does the same way, around the one thing each does its own way: who decides the batch.

:class:`ServedModel` is the base of each ``model.py``'s ``TritonPythonModel``. ``initialize()`` reads and checks the
model's config, builds the metrics, the open requests (the one place that sends), the test-only faults and the
shutdown notice, and asks the model for its engine (:meth:`ServedModel.start_engine`); :meth:`ServedModel.admit`
takes one new request: refused, not valid, or parsed, opened and handed to the model's driver. What is left in a
``model.py`` is its driver: how the engine is built and stepped, and ``execute()``.

Every request gets exactly one final response. Bad input or a refusal is an error response for that request only,
its message built by the contract (backend/contract/errors.py, the kind in front); once the engine failed
(:meth:`ServedModel.fail`) or the server is shutting down, every new request is refused.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import triton_python_backend_utils as pb_utils

from backend.contract import errors
from backend.contract.stop_board import StopBoard
from backend.engine.batching import SHUTTING_DOWN, EngineOverloaded, EngineUnavailable, engine_failed
from backend.engine.config import EngineConfig
from backend.engine.llm_engine import LLMEngine
from backend.engine.sampling_params import SamplingParams
from backend.triton.stub.faults import FaultInjector
from backend.triton.stub.metrics import TritonMetrics, instance_label
from backend.triton.stub.model_config import (
    check_batcher,
    check_model,
    complete_config,
    engine_config_from_triton,
    stream_interval_from_triton,
)
from backend.triton.stub.parsing import RequestLimits, parse_request, read_inputs, read_parameters
from backend.triton.stub.responses import OpenRequest, OpenRequests, send_error
from backend.triton.stub.shutdown_notice import ShutdownNotice
from backend.triton.stub.stream_interval import StreamPacer

# Who takes a new request (its id, prompt, sampling settings, arrival and priority): the engine itself, the engine
# loop or the iteration driver. It refuses one by raising, or by giving it its final output itself
# (IterationDriver.add).
HandOver = Callable[[str, str, SamplingParams, float, int], object]


class ServedModel:
    """The shared part of a served model. A subclass names how it drives the engine, ``class
    TritonPythonModel(ServedModel, batching="continuous")`` (checked against config.pbtxt's ``batching``), and
    implements :meth:`start_engine` and ``execute()``."""

    batching: str

    def __init_subclass__(cls, batching: str, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.batching = batching

    @classmethod
    def auto_complete_config(cls, auto_complete_model_config):
        """Triton calls this before ``initialize()``: the inputs and outputs every model serves and the engine's
        ``max_model_len`` go into the model's config (``complete_config``), so config.pbtxt holds only what an operator
        tunes. The model folder is the one that holds this ``model.py``."""
        model_dir = Path(sys.modules[cls.__module__].__file__).parents[1]
        return complete_config(auto_complete_model_config, str(model_dir))

    def initialize(self, args: dict) -> None:
        self.name = args["model_name"]
        self.model_config = json.loads(args["model_config"])
        config = engine_config_from_triton(self.model_config, args["model_repository"])
        check_model(self.name, self.model_config, config, self.batching)
        check_batcher(self.name, self.model_config, config)
        self.faults = FaultInjector.from_config(self.model_config)
        self.metrics = TritonMetrics(pb_utils, self.name, instance_label(args, self.model_config))
        # A model with max_batch_size > 0 answers with a batch dimension.
        self.open = OpenRequests(pb_utils, self.metrics, batched=int(self.model_config.get("max_batch_size", 0)) > 0,
                                 pacer=StreamPacer(stream_interval_from_triton(self.model_config)),
                                 stop_board=StopBoard.from_env())
        self.failure: str | None = None  # set once the engine failed in a way no step can contain
        self.engine = self.start_engine(config)
        self.engine.fault_hook = self.faults
        self.limits = RequestLimits(self.engine.max_model_len)
        self.observe_steps()
        # On SIGTERM new requests are refused; open ones run on until shortly before tritonserver's exit timeout,
        # and whatever is still running then ends with SHUTTING_DOWN.
        self.shutdown = ShutdownNotice(on_notice=self.on_shutdown)

    def start_engine(self, config: EngineConfig) -> LLMEngine:
        """Build the engine and the driver that decides its batch; return the engine."""
        raise NotImplementedError

    def on_shutdown(self, grace: float) -> None:
        """Called once, on a watcher thread, when the server is told to shut down; new requests are refused from
        then on, and the driver ends what still runs at ``self.shutdown.deadline``."""

    def admit(self, request, arrival: float, hand_over: HandOver) -> str | None:
        """Take one new request: parse it, open it and ``hand_over(request_id, prompt, params, arrival, priority)``
        to the driver (the priority: Triton's level, which the engine reads as vLLM's priority). Returns its id, or
        None once it got its final error: the model refuses new requests (a failed engine, a shutdown), the request is
        not valid, or ``hand_over`` refused it (``ValueError``, or the engine loop's ``EngineOverloaded`` /
        ``EngineUnavailable``). A driver that ends a refused request itself returns normally."""
        sender = request.get_response_sender()
        refusal = self.failure or (SHUTTING_DOWN if self.shutdown.is_set() else None)
        if refusal is None:
            try:
                parsed = parse_request(read_inputs(pb_utils, request), self.limits, read_parameters(request))
            except ValueError as exc:
                refusal = errors.refusal(exc)
        if refusal is not None:
            send_error(pb_utils, sender, refusal)
            return None
        request_id = uuid.uuid4().hex
        self.open.add(request_id, OpenRequest(sender, parsed.stream, arrival, parsed.omitted_outputs,
                                              parsed.requested_outputs, parsed.params.n, priority=parsed.priority,
                                              client_id=request.request_id()))
        if self.faults is not None:
            self.faults.watch(request_id, parsed.prompt)
        try:
            hand_over(request_id, parsed.prompt, parsed.params, arrival, parsed.priority)
        except (ValueError, EngineOverloaded, EngineUnavailable) as exc:  # refused at once: nothing was queued
            self.open.discard(request_id)
            # NOTE: the engine loop's refusals carry their kind already; a ValueError is about the request's values.
            send_error(pb_utils, sender, errors.refusal(exc) if isinstance(exc, ValueError) else str(exc))
            return None
        return request_id

    def count_joined(self) -> None:
        """Before a step, on the thread that steps the engine: publish the engine's gauges with the requests that
        joined it since the last step. A step that never returns then still counts its requests: the stop reads
        these gauges (``backend.triton.launcher.shutdown``), and must never take a server with a request open for
        drained."""
        self.metrics.on_steps(self.engine)

    def observe_steps(self) -> None:
        """After a step, on the thread that steps the engine and sends: publish the engine's steps since the last
        call and its gauges; the stream pacer chooses the next interval."""
        self.open.end_step()
        self.metrics.on_steps(self.engine)

    def fail(self, error: BaseException) -> None:
        """The engine broke in a way no step can contain (the driver gave every open request its final error):
        refuse every later request, and say so on the metrics port (``llm_engine_healthy`` 0) and in the log."""
        self.failure = engine_failed(error)
        pb_utils.Logger.log_error(f"{self.name}: {self.failure}")
        self.metrics.set_healthy(False)

    def finalize(self) -> None:
        pb_utils.Logger.log_info(f"{self.name}: {len(self.open)} requests still open at finalize")

