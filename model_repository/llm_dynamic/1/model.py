"""llm_dynamic (and llm_static): Triton's dynamic batcher decides the batch; execute() runs that batch to completion.

llm_static's 1/model.py is a link to this file: the two differ only in their config.pbtxt (llm_static asks the
batcher for full batches and waits up to a second for one).

The driver (``run_to_completion``, backend/engine/batching.py) steps the engine on execute()'s thread until the
batch's longest member is done. Nothing can join while execute() runs, so the batch shrinks as short answers finish
and Triton queues later requests until it returns (up to default_queue_policy's max_queue_size; beyond it Triton
refuses them at once). Tokens still stream (the model is decoupled) as each step makes them. What every model
shares (parsing, the one place that sends, metrics, refusals, the shutdown notice) is ``ServedModel``.
"""

import time

from backend.engine.openmp import set_wait_policy

set_wait_policy()  # NOTE: before anything imports torch, whose OpenMP runtime reads the wait policy once

from backend.engine.batching import run_to_completion  # noqa: E402
from backend.engine.llm_engine import LLMEngine  # noqa: E402
from backend.triton.stub.responses import CancellationPoll  # noqa: E402
from backend.triton.stub.served_model import ServedModel  # noqa: E402


class TritonPythonModel(ServedModel, batching="run_to_completion"):
    def start_engine(self, config):
        self.cancellations = CancellationPoll(self.open)
        return LLMEngine(config)

    def execute(self, requests):
        arrival = time.perf_counter()
        admitted = [self.admit(request, arrival, self.engine.add_request) for request in requests]
        batch = [request_id for request_id in admitted if request_id is not None]  # Triton's batch, less refusals
        self.count_joined()
        error = run_to_completion(self.engine, batch, sink=self.open.send, cancelled=self.cancellations,
                                  expired=self.shutdown.expired, after_step=self.observe_steps)
        if error is not None:  # every member got its final error
            self.fail(error)
        self.observe_steps()
        return None
