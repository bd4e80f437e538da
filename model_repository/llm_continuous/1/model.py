"""llm_continuous: in-flight (continuous) batching. The engine's loop, on its own thread, decides the batch.

The driver (``EngineLoop``, backend/engine/batching.py) runs the engine on a thread of its own: every step it admits
waiting requests and drops finished ones. execute() hands each request to the loop and returns at once; the loop
sends from one place (its sink); cancellations are polled before a step, within a time budget. What every model shares
(parsing, the one place that sends, metrics, refusals, the shutdown notice) is ``ServedModel``.
"""

import time

from backend.engine.openmp import set_wait_policy

set_wait_policy()  # NOTE: before anything imports torch, whose OpenMP runtime reads the wait policy once

import triton_python_backend_utils as pb_utils  # noqa: E402

from backend.engine.batching import EngineLoop  # noqa: E402
from backend.engine.llm_engine import LLMEngine  # noqa: E402
from backend.triton.stub.responses import CancellationPoll  # noqa: E402
from backend.triton.stub.served_model import ServedModel  # noqa: E402


class TritonPythonModel(ServedModel, batching="continuous"):
    def start_engine(self, config):
        self.cancellations = CancellationPoll(self.open)
        # The engine is loaded on the loop's own thread, the one that steps it: one OpenMP thread team per process.
        self.loop = EngineLoop.build(lambda: LLMEngine(config), sink=self.open.send, before_step=self._cancelled,
                                     after_step=self._observe)
        return self.loop.engine

    def on_shutdown(self, grace):
        self.loop.drain(grace)  # refuse new requests; end those still running after grace seconds

    def execute(self, requests):
        for request in requests:
            self.admit(request, time.perf_counter(), self.loop.submit)  # the loop takes it at its next step
        return None

    # ---- the engine thread ------------------------------------------------------------------------------------

    def _cancelled(self):  # before each step
        self.count_joined()
        return self.cancellations(self.engine.snapshot().running_request_ids)  # the loop thread owns the engine

    def _observe(self):
        self.observe_steps()
        if self.loop.fatal_error is not None and self.failure is None:  # every open request got its final error
            self.fail(self.loop.fatal_error)

    def finalize(self):
        # NOTE: Triton 2.51 finalizes a model only once every client stream that carried its requests is closed (an
        # unload waits for that; a shutdown waits up to --exit-timeout-secs): nobody is left to answer, and a
        # response sent now can block, as the backend no longer reads them. So the loop stops without sending
        # (triton_workarounds.NO_SEND_AT_FINALIZE).
        stopped = self.loop.shutdown(timeout=10, notify=False)
        self.observe_steps()
        message = "engine loop stopped" if stopped else "engine loop did not stop within 10 s"
        pb_utils.Logger.log_info(f"{self.name}: {message} ({len(self.open)} requests still open)")
