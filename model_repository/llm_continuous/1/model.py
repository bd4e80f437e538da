"""llm_continuous: in-flight (continuous) batching. The engine's loop, on its own thread, decides the batch.

A thin adapter: execute() validates each request and hands it to the engine loop (``EngineLoop``,
backend/engine/batching.py), then returns at once; responses are sent from one place (the loop's sink); cancellations
are polled before a step, every 0.2 s. Every request gets exactly one final response: its last token, or an
error (refused, overloaded, a failed step, shutdown, a failed engine).
"""

import json
import time
import uuid

from backend.engine.openmp import set_wait_policy

set_wait_policy()  # NOTE: before anything imports torch, whose OpenMP runtime reads the wait policy once

import triton_python_backend_utils as pb_utils  # noqa: E402

from backend.engine.batching import EngineLoop, EngineOverloaded, EngineUnavailable  # noqa: E402
from backend.engine.llm_engine import LLMEngine  # noqa: E402
from backend.triton.faults import FaultInjector  # noqa: E402
from backend.triton.metrics import TritonMetrics, instance_label  # noqa: E402
from backend.triton.model_config import check_model, engine_config_from_triton  # noqa: E402
from backend.triton.parsing import RequestLimits, parse_request, read_inputs, read_parameters  # noqa: E402
from backend.triton.responses import CancellationPoll, OpenRequest, OpenRequests, send_error  # noqa: E402
from backend.triton.shutdown_notice import ShutdownNotice  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        config = engine_config_from_triton(model_config, args["model_repository"])
        check_model(args["model_name"], model_config, config, batching="continuous")
        self.faults = FaultInjector.from_config(model_config)
        self.metrics = TritonMetrics(pb_utils, args["model_name"], instance_label(args, model_config))
        self.open = OpenRequests(pb_utils, self.metrics, batched=False)
        self.cancellations = CancellationPoll(self.open)
        # The engine is loaded on the loop's own thread, the one that steps it: one OpenMP thread team per process.
        self.loop = EngineLoop.build(lambda: LLMEngine(config), sink=self.open.send, before_step=self._cancelled,
                                     after_step=self._observe)
        self.engine = self.loop.engine
        self.engine.fault_hook = self.faults
        self.limits = RequestLimits(self.engine.max_model_len)
        self.metrics.on_steps(self.engine)  # the loop is idle until the first request
        # On SIGTERM: new requests are refused; open ones run on until shortly before tritonserver's exit timeout,
        # and whatever is still running then ends with "the server is shutting down".
        self.shutdown = ShutdownNotice(on_notice=self.loop.drain)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                parsed = parse_request(read_inputs(pb_utils, request), self.limits, read_parameters(request))
            except ValueError as exc:
                send_error(pb_utils, sender, str(exc))
                continue
            request_id = uuid.uuid4().hex
            open_request = OpenRequest(sender, parsed.stream, time.perf_counter(), parsed.omitted_outputs)
            self.open.add(request_id, open_request)
            if self.faults is not None:
                self.faults.watch(request_id, parsed.prompt)
            try:
                self.loop.submit(request_id, parsed.prompt, parsed.params, open_request.arrival)
            except (EngineOverloaded, EngineUnavailable) as exc:  # refused at once: nothing was queued
                self.open.discard(request_id)
                send_error(pb_utils, sender, str(exc))
        return None

    # ---- the engine thread ------------------------------------------------------------------------------------

    def _cancelled(self):
        return self.cancellations(self.engine.snapshot().running_request_ids)  # the loop thread owns the engine

    def _observe(self):
        self.metrics.on_steps(self.engine)
        self.metrics.set_healthy(self.loop.fatal_error is None)

    def finalize(self):
        # NOTE: Triton 2.51 finalizes a model only once every client stream that carried its requests is closed (an
        # unload waits for that; a shutdown waits up to --exit-timeout-secs): nobody is left to answer, and a
        # response sent now can block, as the backend no longer reads them. So the loop stops without sending.
        stopped = self.loop.shutdown(timeout=10, notify=False)
        self.metrics.on_steps(self.engine)
        message = "engine loop stopped" if stopped else "engine loop did not stop within 10 s"
        pb_utils.Logger.log_info(f"llm_continuous: {message} ({len(self.open)} requests still open)")
