"""llm_continuous: in-flight (continuous) batching. The engine's loop, on its own thread, decides the batch.

A thin adapter: execute() validates each request and hands it to the engine loop, then returns at once; responses
are sent from one place (the loop's sink); cancellations are checked before every step.
"""

import json
import threading
import time
import uuid

import triton_python_backend_utils as pb_utils

from backend.engine import LLMEngine
from backend.engine_loop import EngineLoop
from backend.triton_adapter import (
    MAX_PROMPT_BYTES_PER_TOKEN, OpenRequest, TritonMetrics, engine_config_from_triton, model_is_decoupled,
    parse_request, read_inputs, send_error, send_output,
)


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        if not model_is_decoupled(model_config):
            raise pb_utils.TritonModelException(
                "llm_continuous streams from its own engine thread and must be decoupled: "
                "set model_transaction_policy { decoupled: true } in config.pbtxt"
            )
        config = engine_config_from_triton(model_config, args["model_repository"])
        if config.scheduling_policy != "continuous":
            raise pb_utils.TritonModelException("llm_continuous needs scheduling_policy 'continuous'")
        self.engine = LLMEngine(config)
        self.max_prompt_bytes = MAX_PROMPT_BYTES_PER_TOKEN * config.max_model_len
        self.metrics = TritonMetrics(pb_utils, args["model_name"], self.engine.runner.num_kv_blocks)
        self.open = {}  # request id -> OpenRequest; written by execute(), read and emptied by the loop thread
        self.lock = threading.Lock()
        self.loop = EngineLoop(self.engine, sink=self._send, before_step=self._before_step)
        self.loop.start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                parsed = parse_request(read_inputs(pb_utils, request), self.max_prompt_bytes)
            except ValueError as exc:
                send_error(pb_utils, sender, str(exc))
                continue
            request_id = uuid.uuid4().hex
            open_request = OpenRequest(sender, parsed.stream, arrival=time.perf_counter())
            with self.lock:
                self.open[request_id] = open_request
            try:
                self.loop.submit(request_id, parsed.prompt, parsed.params, open_request.arrival)
            except RuntimeError as exc:  # shutting down, or the engine failed
                with self.lock:
                    self.open.pop(request_id, None)
                send_error(pb_utils, sender, str(exc))
        return None

    # ---- the engine thread ------------------------------------------------------------------------------------

    def _send(self, output):
        with self.lock:
            open_request = self.open.pop(output.request_id, None) if output.finished else self.open.get(output.request_id)
        if open_request is None:
            return
        if output.finished:
            self.metrics.on_finished(output, open_request.arrival)
            self.metrics.on_steps(self.engine)  # an abort frees blocks with no step after it to refresh the gauges
        send_output(pb_utils, open_request, output, batched=False)

    def _before_step(self):
        self.metrics.on_steps(self.engine)
        with self.lock:
            return [rid for rid, r in self.open.items() if r.sender.is_cancelled()]

    def finalize(self):
        self.loop.shutdown(timeout=30)
        self.metrics.on_steps(self.engine)
