"""llm_iterative: Triton's iterative sequence batcher decides the batch at every iteration.

A thin adapter: each execute() gets the requests Triton batched now, new ones (START=1: parsed and handed to the
engine) and rescheduled ones (found by the correlation id Triton gave them), runs one engine step over exactly
those (``IterationDriver``, backend/engine/batching.py), sends what it made, and hands the unfinished ones back
with RELEASE_RESCHEDULE. Every request gets exactly one final response: its last token, or an error (refused,
cancelled, not handed back in time, a failed step, shutdown, a failed engine).

NOTE: Triton 2.51 never hands back a request whose client cancelled while it waited to be rescheduled, so a
timer ends the requests not seen for max_sequence_idle_microseconds and frees their KV blocks, sending nothing:
a response sent for a request Triton has let go of crashes tritonserver (Signal 11 in TRITONBACKEND_ResponseSend).
"""

import json
import threading
import time
import uuid

from backend.engine.openmp import set_wait_policy

set_wait_policy()  # NOTE: before anything imports torch, whose OpenMP runtime reads the wait policy once

import triton_python_backend_utils as pb_utils  # noqa: E402

from backend.engine.batching import SHUTTING_DOWN, IterationDriver, engine_failed  # noqa: E402
from backend.engine.llm_engine import LLMEngine  # noqa: E402
from backend.triton.faults import FaultInjector  # noqa: E402
from backend.triton.metrics import TritonMetrics, instance_label  # noqa: E402
from backend.triton.model_config import check_model, engine_config_from_triton  # noqa: E402
from backend.triton.parsing import RequestLimits, parse_request, read_inputs, read_parameters  # noqa: E402
from backend.triton.responses import OpenRequest, OpenRequests, send_error  # noqa: E402
from backend.triton.shutdown_notice import ShutdownNotice  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        config = engine_config_from_triton(model_config, args["model_repository"])
        check_model(args["model_name"], model_config, config, batching="iterative")
        sequencing = model_config.get("sequence_batching", {})
        if not sequencing.get("iterative_sequence"):
            raise ValueError(f"{args['model_name']} needs sequence_batching {{ iterative_sequence: true }}")
        seats = int(sequencing.get("oldest", {}).get("max_candidate_sequences", 0))
        if not 0 < seats <= config.max_num_seqs or model_config.get("max_batch_size", 0) > config.max_num_seqs:
            raise ValueError(f"max_num_seqs ({config.max_num_seqs}) must be >= max_batch_size and >= oldest "
                             "{ max_candidate_sequences } so that every request Triton hands over can run")
        self.name = args["model_name"]
        self.engine = LLMEngine(config)  # loaded on the thread that steps it: one OpenMP thread team
        self.limits = RequestLimits(self.engine.max_model_len)
        self.faults = FaultInjector.from_config(model_config)
        self.engine.fault_hook = self.faults
        self.metrics = TritonMetrics(pb_utils, self.name, instance_label(args, model_config))
        self.gap = self.metrics.iteration_gap()
        self.open = OpenRequests(pb_utils, self.metrics, batched=True)
        reap_after = int(sequencing.get("max_sequence_idle_microseconds", 5_000_000)) / 1e6
        self.driver = IterationDriver(self.engine, self.open.send, self.open.forget, reap_after,
                                      after_step=lambda: self.metrics.on_steps(self.engine))
        self.request_ids = {}  # Triton's correlation id -> engine request id, while the request is open
        self.released_at = None  # when the last execute() that handed requests back returned
        self.metrics.on_steps(self.engine)
        self.stopping = threading.Event()
        threading.Thread(target=self._reaper, args=(reap_after,), name="reaper", daemon=True).start()
        # On SIGTERM new requests are refused; open ones run on until shortly before tritonserver's exit timeout,
        # and whatever is still running then ends with "the server is shutting down".
        self.shutdown = ShutdownNotice()

    def execute(self, requests):
        started = time.perf_counter()
        handed = {}  # engine request id -> this iteration's Triton request
        for request in requests:
            correlation_id = int(pb_utils.get_input_tensor_by_name(request, "CORRID").as_numpy().item())
            sender = request.get_response_sender()
            if pb_utils.get_input_tensor_by_name(request, "START").as_numpy().item():
                request_id = self._start(correlation_id, request, sender, started)
            else:  # rescheduled; unknown once the driver ended it (its final response went out then)
                if self.released_at is not None:  # the hand-back: the last execute()'s end to this one's start
                    self.gap.observe(started - self.released_at)
                    self.released_at = None
                request_id = self.request_ids.get(correlation_id)
                if request_id is not None and not self.open.rebind(request_id, sender):
                    request_id = None
            if request_id is None:
                self.request_ids.pop(correlation_id, None)
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL)
            else:
                handed[request_id] = (correlation_id, request)

        failed_before = self.driver.fatal_error is not None
        unfinished = self.driver.iterate(handed, cancelled=self.open.cancelled, expired=self.shutdown.expired)
        if self.driver.fatal_error is not None and not failed_before:  # every open request got its final error
            pb_utils.Logger.log_error(f"{self.name}: {engine_failed(self.driver.fatal_error)}")
            self.metrics.engine_healthy.set(0)
        for request_id, (correlation_id, request) in handed.items():
            if request_id in unfinished:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
            else:
                self.request_ids.pop(correlation_id, None)
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL)
        # Requests the driver reaped (Triton let go of them) never come back: forget them.
        self.request_ids = {c: r for c, r in self.request_ids.items() if self.driver.is_open(r)}
        self.released_at = time.perf_counter() if unfinished else None
        return None

    def _start(self, correlation_id, request, sender, arrival):
        """A new request: parse it and hand it to the engine; None if it got its final (error) response."""
        if self.driver.fatal_error is not None or self.shutdown.is_set():
            failure = self.driver.fatal_error
            send_error(pb_utils, sender, engine_failed(failure) if failure is not None else SHUTTING_DOWN)
            return None
        try:
            parsed = parse_request(read_inputs(pb_utils, request), self.limits, read_parameters(request))
        except ValueError as exc:
            send_error(pb_utils, sender, str(exc))
            return None
        request_id = uuid.uuid4().hex
        self.open.add(request_id, OpenRequest(sender, parsed.stream, arrival, parsed.omitted_outputs))
        if self.faults is not None:
            self.faults.watch(request_id, parsed.prompt)
        if not self.driver.add(request_id, parsed.prompt, parsed.params, arrival):
            return None  # refused: the driver sent its final error
        self.request_ids[correlation_id] = request_id
        return request_id

    def _reaper(self, period):
        while not self.stopping.wait(period):
            self.driver.reap()

    def finalize(self):
        self.stopping.set()
        pb_utils.Logger.log_info(f"{self.name}: {len(self.open)} requests still open at finalize")
