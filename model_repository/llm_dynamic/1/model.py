"""llm_dynamic (and llm_static): Triton's dynamic batcher decides the batch; execute() runs that batch to completion.

llm_static's 1/model.py is a link to this file: the two differ only in their config.pbtxt (llm_static asks the
batcher for full batches and waits up to a second for one).

A thin adapter: parse each request, hand the batch to the engine, and send from one place while
``run_to_completion`` (backend/engine/batching.py) steps it. Nothing can join while execute() runs, so the batch
shrinks as short answers finish and Triton queues later requests until it returns (up to default_queue_policy's
max_queue_size; beyond it Triton refuses them at once). Tokens still stream (the model is decoupled) as each step
makes them. Every request gets exactly one final response: its last token, or an error (refused, cancelled, a
failed step, shutdown, a failed engine).
"""

import json
import time
import uuid

from backend.engine.openmp import set_wait_policy

set_wait_policy()  # NOTE: before anything imports torch, whose OpenMP runtime reads the wait policy once

import triton_python_backend_utils as pb_utils  # noqa: E402

from backend.engine.batching import SHUTTING_DOWN, engine_failed, run_to_completion  # noqa: E402
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
        check_model(args["model_name"], model_config, config, batching="run_to_completion")
        if config.max_num_seqs < model_config.get("max_batch_size", 0):
            raise pb_utils.TritonModelException(
                f"max_num_seqs ({config.max_num_seqs}) must be >= max_batch_size so a whole batch runs together"
            )
        self.name = args["model_name"]
        self.engine = LLMEngine(config)
        self.limits = RequestLimits(self.engine.max_model_len)
        self.faults = FaultInjector.from_config(model_config)
        self.engine.fault_hook = self.faults
        self.metrics = TritonMetrics(pb_utils, self.name, instance_label(args, model_config))
        self.metrics.on_steps(self.engine)
        self.open = OpenRequests(pb_utils, self.metrics, batched=True)
        self.cancellations = CancellationPoll(self.open)
        self.failure = None  # set once the engine failed in a way a step cannot recover from
        # On SIGTERM the batch running goes on until shortly before tritonserver's exit timeout, and whatever is still
        # running then ends with "the server is shutting down". Every later batch is refused at once: Triton 2.51
        # still passes on requests that arrive over connections already open.
        self.shutdown = ShutdownNotice()

    def execute(self, requests):
        arrival = time.perf_counter()
        batch = []  # the ids of exactly the requests Triton put in this batch
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
            self.open.add(request_id, OpenRequest(sender, parsed.stream, arrival, parsed.omitted_outputs))
            batch.append(request_id)

        error = run_to_completion(
            self.engine, batch, sink=self.open.send, cancelled=self.cancellations, expired=self.shutdown.expired,
            after_step=lambda: self.metrics.on_steps(self.engine),
        )
        if error is not None:  # every member got its final error; refuse every later request
            self.failure = engine_failed(error)
            pb_utils.Logger.log_error(f"{self.name}: {self.failure}")
            self.metrics.set_healthy(False)
        self.metrics.on_steps(self.engine)
        return None
