"""llm_dynamic (and llm_static): Triton's dynamic batcher decides the batch; execute() runs that batch to completion.

llm_static's 1/model.py is a link to this file: the two differ only in their config.pbtxt (llm_static asks the
batcher for full batches and waits up to a second for one).

Nothing can join while execute() runs, so the batch shrinks as short answers finish and Triton queues later
requests until it returns (up to default_queue_policy's max_queue_size; beyond it Triton refuses them at once).
Tokens still stream (the model is decoupled) as each step makes them. Every request gets exactly one final
response: its last token, or an error (refused, cancelled, a failed step, shutdown, a failed engine).
"""

import json
import time
import uuid

import triton_python_backend_utils as pb_utils

from backend.engine.engine_loop import SHUTTING_DOWN
from backend.engine.llm_engine import LLMEngine
from backend.triton.faults import FaultInjector
from backend.triton.metrics import TritonMetrics
from backend.triton.model_config import engine_config_from_triton, model_is_decoupled
from backend.triton.parsing import RequestLimits, parse_request, read_inputs, read_parameters
from backend.triton.responses import OpenRequest, send_error, send_output
from backend.triton.shutdown_notice import ShutdownNotice


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        if not model_is_decoupled(model_config):
            raise pb_utils.TritonModelException(f"{args['model_name']} streams tokens and must be decoupled")
        config = engine_config_from_triton(model_config, args["model_repository"])
        if config.max_num_seqs < model_config.get("max_batch_size", 0):
            raise pb_utils.TritonModelException(
                f"max_num_seqs ({config.max_num_seqs}) must be >= max_batch_size so a whole batch runs together"
            )
        self.name = args["model_name"]
        self.engine = LLMEngine(config)
        self.limits = RequestLimits(self.engine.max_model_len)
        self.faults = FaultInjector.from_config(model_config)
        self.engine.fault_hook = self.faults
        self.metrics = TritonMetrics(pb_utils, args["model_name"], self.engine.runner.num_kv_blocks)
        self.failure = None  # set once the engine failed in a way a step cannot recover from
        # On SIGTERM the batch running goes on until shortly before tritonserver's exit timeout, and whatever is still
        # running then ends with "the server is shutting down". Every later batch is refused at once: Triton 2.51
        # still passes on requests that arrive over connections already open.
        self.shutdown = ShutdownNotice()

    def execute(self, requests):
        arrival = time.perf_counter()
        batch = {}  # request id -> OpenRequest: exactly the requests Triton put in this batch
        for request in requests:
            sender = request.get_response_sender()
            if self.failure is not None or self.shutdown.is_set():
                send_error(pb_utils, sender, self.failure or SHUTTING_DOWN)
                continue
            try:
                parsed = parse_request(read_inputs(pb_utils, request), self.limits, read_parameters(request))
                request_id = uuid.uuid4().hex
                if self.faults is not None:
                    self.faults.watch(request_id, parsed.prompt)
                self.engine.add_request(request_id, parsed.prompt, parsed.params, arrival)
            except ValueError as exc:
                send_error(pb_utils, sender, str(exc))
                continue
            batch[request_id] = OpenRequest(sender, parsed.stream, arrival, parsed.omitted_outputs)

        try:
            self._run_to_completion(batch)
        except BaseException as exc:  # the engine cannot go on: fail this batch, refuse every later request
            self._fail(batch, exc)
        self.metrics.on_steps(self.engine)
        return None

    def _run_to_completion(self, batch):
        while self.engine.has_unfinished():  # until the longest member of the batch is done
            if self.shutdown.expired():
                self._abort_all(batch, SHUTTING_DOWN)
                return
            outputs = [self.engine.abort(rid) for rid, r in batch.items() if r.sender.is_cancelled()]
            outputs += self.engine.step()
            self.metrics.on_steps(self.engine)
            for output in filter(None, outputs):
                open_request = batch.pop(output.request_id) if output.finished else batch[output.request_id]
                if output.finished:
                    self.metrics.on_finished(output, open_request.arrival)
                try:
                    send_output(pb_utils, open_request, output, batched=True)
                except Exception as exc:  # a vanished client must not stop the rest of the batch
                    pb_utils.Logger.log_warn(f"{self.name}: sending to {output.request_id} failed: {exc}")

    def _fail(self, batch, exc):
        self.failure = f"the engine failed and cannot go on ({exc!r}); restart the server"
        pb_utils.Logger.log_error(f"{self.name}: {self.failure}")
        self.metrics.engine_healthy.set(0)
        self._abort_all(batch, self.failure)

    def _abort_all(self, batch, message):
        """End every open member of the batch with an error response."""
        for request_id, open_request in batch.items():
            try:
                self.engine.abort(request_id)  # frees its KV blocks if the engine's state still allows it
            except Exception:
                pass
            try:
                send_error(pb_utils, open_request.sender, message)
            except Exception as exc:
                pb_utils.Logger.log_warn(f"{self.name}: sending to {request_id} failed: {exc}")
        batch.clear()
