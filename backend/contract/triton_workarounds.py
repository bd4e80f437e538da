"""Every workaround the project carries for the bundled tritonserver 2.51, in one place.

The only ``tritonserver`` on PyPI is the one inside ``nvidia-pytriton`` 0.7.0: Triton 2.51 (release 24.10). Each
entry says what 2.51 does, what the project does about it, where upstream stands, when the workaround can go, and
which modules carry it. Those modules name their entry (``triton_workarounds.NAME``) where the workaround sits, so a
reader can go from the code to the reason and from the reason to every place it shaped;
``tests/unit/test_triton_workarounds.py`` keeps both directions true, and no module speaks of 2.51 without naming
an entry. ``python -m backend.contract.triton_workarounds`` prints the list.

Moving to a newer tritonserver: for each entry, run the check it names on the new version, then remove the
workaround and its entry together.

Standard library only (the contract's rule): the stub, the launcher, the frontend and the load tests all name these.
"""

from __future__ import annotations

from dataclasses import dataclass

TRITON_VERSION = "2.51"  # release 24.10, inside nvidia-pytriton 0.7.0


@dataclass(frozen=True)
class Workaround:
    name: str
    problem: str  # what tritonserver 2.51 does
    remedy: str  # what the project does about it
    upstream: str  # the report or fix upstream, or what is known
    remove_when: str  # the version from which it can go, and the check that says so
    modules: tuple[str, ...]  # repository paths of the modules that carry it (each names this entry)


GRPC_CANCEL_RACE = Workaround(
    "GRPC_CANCEL_RACE",
    "a client that cancels a gRPC stream while its responses are being sent can crash tritonserver (Signal 11 in "
    "ModelStreamInferHandler::Process: the stream's state is freed while its cancellation notice is still queued); "
    "now and then the crash handler itself deadlocks and the process hangs",
    "the OpenAI frontend never cancels a stream: it posts the request on the stop board and the model ends it with "
    "its final response; the launcher names a crash's site and restarts a crashed or hung server; the stop closes "
    "only idle gRPC connections; make storm counts the crashes a cancelling tritonclient causes",
    "fixed upstream: triton-inference-server/server pull requests 7840 (24.12) and 8078 (25.03)",
    "tritonserver 2.56 (25.03) or later: make storm --protocol grpc with 0 crashes in 20,000 cancellations",
    ("backend/contract/stop_board.py", "frontend/openai/triton_bridge.py", "backend/triton/launcher/crash.py",
     "backend/triton/launcher/serve.py", "backend/triton/launcher/shutdown.py", "loadtest/storm.py"),
)

CANCEL_AFTER_FINAL_HOLDS_MODEL = Workaround(
    "CANCEL_AFTER_FINAL_HOLDS_MODEL",
    "a gRPC request cancelled right after its final response is now and then never released by the gRPC frontend: "
    "its model can never unload, and a shutdown waits for it until the exit timeout, then exits 1",
    "the stop ends the stubs and tritonserver once only unloading is left, nothing is open and the stubs sit idle, "
    "says so in one 'forced:' line and reports exit 0; the soak counts how often",
    "not reported upstream as such; the same request-state handling as GRPC_CANCEL_RACE, reworked in 7840 and 8078",
    "a server where make soak's fresh_stream_cancel_after_final cells stop with no forced unload",
    ("backend/triton/launcher/shutdown.py", "loadtest/soak.py"),
)

SINGLE_SENDER = Workaround(
    "SINGLE_SENDER",
    "Python-backend responses sent from several threads at once crashed tritonserver (Signal 11)",
    "each model sends from one thread at a time: the thread that steps the engine (OpenRequests), or under "
    "llm_iterative's lock",
    "no upstream report found",
    "a newer server on which tests/server/test_reliability.py passes with responses sent from two threads",
    ("backend/triton/stub/responses.py", "model_repository/llm_iterative/1/model.py"),
)

CANCEL_CHECK_AFTER_FINAL = Workaround(
    "CANCEL_CHECK_AFTER_FINAL",
    "asking whether a request was cancelled (is_cancelled) after its final response was sent crashed tritonserver "
    "(Signal 11 in TRITONBACKEND_ResponseFactoryIsCancelled) during a burst of refusals",
    "requests are asked under the lock that closes them, so a closed request is never asked; each ask is an IPC "
    "round trip (~35 us), so the stepping thread asks within a budget of its time (CancellationPoll)",
    "no upstream report found",
    "a newer server on which tests/server/test_reliability.py's refusal bursts pass with the lock removed",
    ("backend/triton/stub/responses.py",),
)

NO_SEND_WHILE_TRITON_HOLDS = Workaround(
    "NO_SEND_WHILE_TRITON_HOLDS",
    "llm_iterative: a request handed back to Triton's sequence batcher (RELEASE_RESCHEDULE) may be answered by "
    "Triton itself (a client's cancel found in its queue); a response the model sends to it then crashes "
    "tritonserver, and a cancel that falls between a release and the next batch keeps the slot until the idle reaper",
    "what an iteration makes is sent only while the model holds the request again or once it is released for good; "
    "a request whose client cancelled is handed back for Triton to answer; one Triton never hands back is reaped",
    "Triton's iterative sequence batching is young; no upstream report found",
    "a newer server on which tests/server/test_reliability.py's llm_iterative cancellations pass with sends made at "
    "once",
    ("backend/triton/stub/iteration_book.py", "model_repository/llm_iterative/1/model.py",
     "backend/engine/batching.py"),
)

CLIENT_SEQUENCE_RELAY = Workaround(
    "CLIENT_SEQUENCE_RELAY",
    "the iterative sequence batcher cannot hand back a request that carries its client's own sequence (a "
    "correlation id with START and END, what perf_analyzer and genai-perf send a sequence model); a sequence of "
    "several requests is closed by the first release",
    "such a request is served through a copy without the client's sequence; the second request of a longer "
    "sequence is answered at once with an error that says what to send",
    "no upstream report found",
    "a newer server on which genai-perf's and perf_analyzer's defaults run against llm_iterative without the relay",
    ("backend/triton/stub/sequence_relay.py",),
)

NO_SEND_AT_FINALIZE = Workaround(
    "NO_SEND_AT_FINALIZE",
    "a Python model is finalized only once every client stream that carried its requests is closed; a response "
    "sent then can block for good, as the backend no longer reads them",
    "finalize() stops the engine's loop without sending",
    "the Python backend's documented order (finalize after the model's requests are done)",
    "keep: it is how the Python backend finalizes",
    ("model_repository/llm_continuous/1/model.py",),
)

SHUTDOWN_NOT_FORWARDED = Workaround(
    "SHUTDOWN_NOT_FORWARDED",
    "on SIGTERM tritonserver tells its Python-backend stubs nothing until it finalizes them, waits for every open "
    "HTTP connection and counts no request of a decoupled Python model as in flight",
    "the stop signals the stubs too (ShutdownNotice: they refuse new requests and finish running ones), waits for "
    "the engines' own gauges, then shuts down the client connections left open",
    "Triton's documented shutdown: the exit timeout bounds it",
    "a newer server on which tests/server/test_shutdown.py passes with a plain SIGTERM",
    ("backend/triton/launcher/shutdown.py", "backend/triton/stub/shutdown_notice.py"),
)

NO_REQUEST_PRIORITY = Workaround(
    "NO_REQUEST_PRIORITY",
    "a Python model cannot read a request's own Triton priority, which only Triton's dynamic batcher sees",
    "clients send the level twice: as the request's priority (which orders the dynamic batcher's queue) and as the "
    "priority input, which the engine and the metrics read",
    "not exposed by the Python backend's InferenceRequest in 24.10",
    "a Python backend whose requests carry their priority",
    ("backend/contract/io_schema.py", "backend/triton/stub/parsing.py", "client/schema.py"),
)

ERROR_IS_A_MESSAGE = Workaround(
    "ERROR_IS_A_MESSAGE",
    "an error reaches a client as its message alone (pb_utils.TritonError), and HTTP /generate answers 400 to "
    "every model error",
    "every message starts with its kind as a code in brackets, which the frontend maps to an HTTP status",
    "no upstream report found: a decoupled model's error response reaches a gRPC stream as error_message only",
    "a server whose gRPC stream and HTTP /generate carry an error's code to the client",
    ("backend/contract/errors.py", "backend/triton/stub/responses.py"),
)

READY_AFTER_ENGINE_FAILURE = Workaround(
    "READY_AFTER_ENGINE_FAILURE",
    "a Python model stays READY after its engine failed: Triton offers a model no way to say it is unhealthy",
    "the model publishes llm_engine_healthy on the metrics port, and the launcher's probe reads it",
    "the Python backend has no health callback",
    "keep",
    ("backend/triton/stub/metrics.py", "backend/triton/launcher/probe.py"),
)

ALL: tuple[Workaround, ...] = (
    GRPC_CANCEL_RACE, CANCEL_AFTER_FINAL_HOLDS_MODEL, SINGLE_SENDER, CANCEL_CHECK_AFTER_FINAL,
    NO_SEND_WHILE_TRITON_HOLDS, CLIENT_SEQUENCE_RELAY, NO_SEND_AT_FINALIZE, SHUTDOWN_NOT_FORWARDED,
    NO_REQUEST_PRIORITY, ERROR_IS_A_MESSAGE, READY_AFTER_ENGINE_FAILURE,
)


def main() -> None:
    for workaround in ALL:
        print(f"{workaround.name}\n  2.51: {workaround.problem}\n  here: {workaround.remedy}\n"
              f"  upstream: {workaround.upstream}\n  goes: {workaround.remove_when}\n"
              f"  in: {', '.join(workaround.modules)}\n")


if __name__ == "__main__":
    main()
