"""llm_dynamic: Triton's dynamic batcher decides the batch; execute() runs exactly that batch to completion.

Nothing can join while execute() runs, so the batch shrinks as short answers finish and Triton queues later
requests until it returns. Tokens still stream (the model is decoupled) as each step makes them.
"""

import json
import time
import uuid

import triton_python_backend_utils as pb_utils

from backend.engine import LLMEngine
from backend.triton_adapter import (
    MAX_PROMPT_BYTES_PER_TOKEN, OpenRequest, TritonMetrics, engine_config_from_triton, model_is_decoupled,
    parse_request, read_inputs, send_error, send_output,
)


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        if not model_is_decoupled(model_config):
            raise pb_utils.TritonModelException("llm_dynamic streams tokens and must be decoupled")
        config = engine_config_from_triton(model_config, args["model_repository"])
        if config.max_num_seqs < model_config.get("max_batch_size", 0):
            raise pb_utils.TritonModelException(
                f"max_num_seqs ({config.max_num_seqs}) must be >= max_batch_size so a whole batch runs together"
            )
        self.engine = LLMEngine(config)
        self.max_prompt_bytes = MAX_PROMPT_BYTES_PER_TOKEN * config.max_model_len
        self.metrics = TritonMetrics(pb_utils, args["model_name"], self.engine.runner.num_kv_blocks)

    def execute(self, requests):
        arrival = time.perf_counter()
        batch = {}  # request id -> OpenRequest: exactly the requests Triton put in this batch
        for request in requests:
            sender = request.get_response_sender()
            try:
                parsed = parse_request(read_inputs(pb_utils, request), self.max_prompt_bytes)
                request_id = uuid.uuid4().hex
                self.engine.add_request(request_id, parsed.prompt, parsed.params, arrival)
            except ValueError as exc:
                send_error(pb_utils, sender, str(exc))
                continue
            batch[request_id] = OpenRequest(sender, parsed.stream, arrival=arrival)

        while self.engine.has_unfinished():  # until the longest member of the batch is done
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
                    pb_utils.Logger.log_warn(f"llm_dynamic: sending to {output.request_id} failed: {exc}")
        self.metrics.on_steps(self.engine)
        return None
