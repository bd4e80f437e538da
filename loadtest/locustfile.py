"""Locust users that stream generations from a Triton LLM model and report per-token latencies.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --model llm_continuous      # web UI on :8089
    locust --config loadtest/locust.conf --headless -u 8 -t 60s GrpcStreamUser               # headless

Three users, the same measurements: ``GrpcStreamUser`` (tritonclient gRPC bidirectional streaming),
``HttpStreamUser`` (Triton's HTTP ``/v2/models/<model>/generate_stream``, server-sent events) and
``OpenAIStreamUser`` (the OpenAI-compatible frontend's streamed ``/v1/completions``, ``--openai-url``). Each request is
timed with ``perf_counter`` and is one Locust request event, named ``<model> (e2e)``, timed end to end
(response_length: output tokens), so Locust's requests/s, counts and failures are requests. What cannot be summed
across requests (TTFT, TPOT, the longest inter-token gap, whether both SLOs held) goes to the latency table
(``loadtest/live.py``): the web UI's "LLM batching (live)" tab, its CSV among Locust's downloads, and
``<--csv prefix>_llm_latency.csv``. With the web UI, that tab also shows every model's batch, queues, KV blocks and
tokens/s from the metrics port (``--metrics-url``), live.

``--model`` may name several models (``llm_dynamic,llm_continuous``): users are dealt to them in turn, each model
gets the same request sequence, and ``--max-requests`` is per model.

``--workload mixed`` deals each model's first ``--interactive-users`` users the interactive class and the others the
batch class (``loadtest/workloads.py``), each class its own request sequence; with ``--priorities`` each request is
sent at its class's Triton priority level (interactive 1, batch 3), without it at none. Each record names its class.

Errors and truncated streams (no final response, no finish_reason, fewer tokens than ``max_tokens`` although
``ignore_eos`` is set) are Locust failures, never exceptions. ``--arrival-rate R`` turns the closed loop (each
user sends its next request as soon as the last finished) into an open loop: Poisson arrivals at R req/s spread
over the users, so there must be more users than requests in flight. ``--records-file`` writes one JSON line per
request (with its token arrival times) for ``loadtest.compare``.
"""

from __future__ import annotations

# NOTE: locust has already monkey-patched the standard library; gRPC needs its own gevent integration before any
# channel exists, or its threads block the whole process.
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

import collections  # noqa: E402
import dataclasses  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from urllib.parse import urlparse  # noqa: E402

import gevent  # noqa: E402
import requests  # noqa: E402
import tritonclient.grpc as grpcclient  # noqa: E402
from gevent import GreenletExit  # noqa: E402
from locust import User, events, task  # noqa: E402
from locust.exception import StopUser  # noqa: E402
from locust.runners import STATE_RUNNING, STATE_SPAWNING  # noqa: E402
from locust.stats import CSV_STATS_INTERVAL_SEC  # noqa: E402

from backend.contract.names import CONTINUOUS  # noqa: E402
from backend.contract.priority import openai_priority  # noqa: E402
from client.grpc_stream import GrpcStream  # noqa: E402
from client.schema import Chunk, GenerationRequest, build_inputs, parse_chunk  # noqa: E402
from loadtest import DEFAULT_SLO_TPOT_MS, DEFAULT_SLO_TTFT_MS  # noqa: E402
from loadtest.live import LatencyBook, LiveView, attach_to_locust  # noqa: E402
from loadtest.measure import Measurement, StreamError  # noqa: E402
from loadtest.workloads import WORKLOAD_NAMES, deal_user, get_workload, make_request  # noqa: E402


@events.init_command_line_parser.add_listener
def _add_options(parser) -> None:
    group = parser.add_argument_group("LLM streaming (loadtest/locustfile.py)")
    group.add_argument(
        "--model",
        default=CONTINUOUS,
        help="Triton model to load, or several, comma-separated (default: %(default)s)",
    )
    group.add_argument(
        "--grpc-url", default="", help="host:port of Triton's gRPC endpoint (default: --host's host, port 8001)"
    )
    group.add_argument(
        "--openai-url", default="", help="the OpenAI frontend's base URL (default: --host's host, port 9000)"
    )
    group.add_argument("--workload", default="long_tailed", choices=WORKLOAD_NAMES, help="default: %(default)s")
    group.add_argument(
        "--length-scale", type=float, default=1.0, help="multiply prompt and output lengths (default: %(default)s)"
    )
    group.add_argument("--seed", type=int, default=0, help="workload seed: request i is the same on every run")
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    group.add_argument(
        "--slo-ttft-ms", type=float, default=DEFAULT_SLO_TTFT_MS, help="TTFT limit for goodput (default: %(default)s)"
    )
    group.add_argument(
        "--slo-tpot-ms", type=float, default=DEFAULT_SLO_TPOT_MS, help="TPOT limit for goodput (default: %(default)s)"
    )
    group.add_argument(
        "--arrival-rate",
        type=float,
        default=0.0,
        help="open loop: Poisson arrivals per second over all users; 0 = closed loop",
    )
    group.add_argument(
        "--priority", type=int, default=0,
        help="Triton's priority level of every request: 1 the highest (interactive), 3 batch; 0: the default level",
    )
    group.add_argument(
        "--interactive-users", type=int, default=1,
        help="--workload mixed: this many users of each model are interactive, the others batch (default: %(default)s)",
    )
    group.add_argument(
        "--priorities", action="store_true",
        help="--workload mixed: send each request at its class's priority level (interactive 1, batch 3)",
    )
    group.add_argument(
        "--max-requests", type=int, default=0, help="stop after issuing this many requests per model (0: no limit)"
    )
    group.add_argument("--request-timeout", type=float, default=300.0, help="seconds before a request counts as failed")
    group.add_argument(
        "--records-file", default="", help="append one JSON line per request here (for loadtest.compare)"
    )
    group.add_argument(
        "--metrics-url", default="", help="Triton's metrics port for the live tab (default: --host's host, port 8002)"
    )


def _models(options) -> list[str]:
    return [m.strip() for m in options.model.split(",") if m.strip()]


# ---- the run: request numbering, the request budget, the records file ---------------------------------------


class Run:
    """What all users of this process share: each model's next request index, the budget, the records file."""

    def __init__(self, environment) -> None:
        options = environment.parsed_options
        self.environment = environment
        self.workload = get_workload(options.workload, options.length_scale)
        self.seed = options.seed
        self.max_requests = options.max_requests
        self._num_issued = {model: itertools.count() for model in _models(options)}
        self._next_index = collections.defaultdict(itertools.count)  # (model, class): each class's own sequence
        self._spent: set[str] = set()
        self.in_flight = 0
        self.issuing = True
        self._records = open(options.records_file, "a", buffering=1) if options.records_file else None

    def next_request(self, model: str, traffic_class: str = ""):
        """The model's next request (of ``traffic_class`` in a mixed workload), or None once the model's budget is
        spent (the run ends when every model's is, and the requests in flight have ended)."""
        if self.max_requests and next(self._num_issued[model]) >= self.max_requests:
            self._spent.add(model)
            if self.issuing and self._spent == set(self._num_issued):
                self.issuing = False
                self.write({"event": "stop_issuing", "t": time.time(), "reason": "max_requests"})
                # NOTE: the last request may have ended before any user found the budget spent.
                self._end_if_drained()
            return None
        self.in_flight += 1
        return make_request(self.workload, next(self._next_index[model, traffic_class]), self.seed, traffic_class)

    def done(self, record: dict) -> None:
        self.in_flight -= 1
        self.write(record)
        self._end_if_drained()

    def _end_if_drained(self) -> None:
        """Once no request is issued any more and none is in flight: headless, end the run; with the web UI, stop
        the test and keep the UI up."""
        runner = self.environment.runner
        if (
            not self.issuing
            and self.in_flight == 0
            and runner is not None
            and runner.state in (STATE_SPAWNING, STATE_RUNNING)
        ):
            gevent.spawn(runner.quit if self.environment.parsed_options.headless else runner.stop)

    def write(self, record: dict) -> None:
        if self._records is not None:
            self._records.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._records is not None:
            self._records.close()
            self._records = None


_run: Run | None = None
_book: LatencyBook | None = None  # the latencies Locust's one event per request cannot hold (this process's)


@events.init.add_listener
def _on_init(environment, web_ui=None, **_kwargs) -> None:
    global _book
    options = environment.parsed_options
    if options is None:
        return
    _book = LatencyBook(options.slo_ttft_ms, options.slo_tpot_ms)
    if web_ui is not None:
        metrics_url = options.metrics_url or _default_metrics_url(environment.host)
        attach_to_locust(web_ui, LiveView(_book, metrics_url).start())


@events.reset_stats.add_listener
def _on_reset_stats(**_kwargs) -> None:
    if _book is not None:
        _book.reset()


@events.test_start.add_listener
def _on_test_start(environment, **_kwargs) -> None:
    global _run
    if environment.parsed_options is None:
        return
    _run = Run(environment)
    o = environment.parsed_options
    _run.write(
        {
            "event": "test_start",
            "t": time.time(),
            "model": o.model,
            "workload": _run.workload.describe(),
            "arrival_rate": o.arrival_rate,
            "max_requests": o.max_requests,
        }
    )


@events.test_stopping.add_listener
def _on_test_stopping(environment, **_kwargs) -> None:
    if _run is not None:
        _run.write({"event": "stop_issuing", "t": time.time(), "reason": "stopping"})


@events.test_stop.add_listener
def _on_test_stop(environment, **_kwargs) -> None:
    if _run is not None:
        _run.write({"event": "test_stop", "t": time.time()})
        _run.close()


@events.quitting.add_listener
def _on_quitting(environment, **_kwargs) -> None:
    # NOTE: Locust writes its CSV once a second and not again at exit; requests that ended in the last second of
    # the drain would be missing from it without one more tick of the writer.
    if environment.parsed_options is not None and environment.parsed_options.csv_prefix:
        gevent.sleep(CSV_STATS_INTERVAL_SEC + 0.2)
        if _book is not None:
            with open(f"{environment.parsed_options.csv_prefix}_llm_latency.csv", "w") as f:
                f.write(_book.to_csv())


# ---- the users ----------------------------------------------------------------------------------------------


class StreamingLLMUser(User):
    """Sends the workload's requests one after another and reports what each stream measured."""

    abstract = True
    protocol = "?"
    _dealt = itertools.count()  # users are dealt to the models in turn

    def __init__(self, environment) -> None:
        super().__init__(environment)
        self.options = environment.parsed_options
        models, number = _models(self.options), next(StreamingLLMUser._dealt)
        self.model = models[number % len(models)]
        self.traffic_class = self.priority = None  # the class, and its level with --priorities (mixed workload)
        if self.options.workload == "mixed":
            self.model, self.traffic_class = deal_user(number, models, self.options.interactive_users)
            if self.options.priorities:
                self.priority = get_workload(self.options.workload).traffic_class(self.traffic_class).priority
        self._rng = random.Random(f"arrivals:{self.options.seed}:{id(self)}")
        self._next_arrival = None

    def wait_time(self) -> float:
        """Closed loop: no wait. Open loop: this user's share of a Poisson process at --arrival-rate."""
        rate = self.options.arrival_rate
        if rate <= 0:
            return 0.0
        users = max(1, self.environment.runner.target_user_count or 1) if self.environment.runner else 1
        now = time.perf_counter()
        if self._next_arrival is None:
            self._next_arrival = now
        self._next_arrival += self._rng.expovariate(rate / users)
        return max(0.0, self._next_arrival - now)

    def on_start(self) -> None:
        if self.options.arrival_rate > 0:
            gevent.sleep(self.wait_time())

    @task
    def generate(self) -> None:
        spec = _run.next_request(self.model, self.traffic_class or "") if _run is not None else None
        if spec is None:
            raise StopUser()
        request = GenerationRequest(
            spec.prompt,
            max_tokens=spec.max_tokens,
            ignore_eos=True,
            stream=True,
            temperature=self.options.temperature,
            seed=spec.index,
            priority=self.priority or self.options.priority or None,
        )
        m = Measurement(spec.index, spec.max_tokens, time.time(), traffic_class=self.traffic_class,
                        priority=request.priority)
        t0 = time.perf_counter()
        try:
            for chunk in self.stream(request, t0):
                m.add(chunk)
            m.e2e_s = time.perf_counter() - t0
            m.check_complete()
        except StreamError as exc:
            m.error = str(exc)
        except Exception as exc:  # a client-library surprise is this request's failure, not the user's death
            m.error = f"{type(exc).__name__}: {exc}"
        except GreenletExit:  # the run ended (--stop-timeout) with this stream still open: not a failure, but known
            m.cut, m.e2e_s = True, time.perf_counter() - t0
            _run.done(self.record(m))
            raise
        m.e2e_s = m.e2e_s or time.perf_counter() - t0
        self.report(m)
        record = self.record(m)
        _run.done(record)
        if _book is not None:
            _book.add(self.model, record, t_end=time.time())

    def record(self, m: Measurement) -> dict:
        return {**m.record(), "model": self.model}

    def stream(self, request: GenerationRequest, t0: float):
        """Send ``request`` at ``t0``; yield a ``client.schema.Chunk`` per response (``time_s`` since ``t0``).

        Raise :class:`StreamError` on an error response, a broken stream, or after --request-timeout.
        """
        raise NotImplementedError

    def report(self, m: Measurement) -> None:
        """One Locust event per request, timed end to end (ms); a failed request is a failed event."""
        self.environment.events.request.fire(
            request_type=self.protocol,
            name=event_name(self.model),
            response_time=1000 * m.e2e_s,
            response_length=m.num_output_tokens,
            exception=None if m.error is None else StreamError(m.error),
            context={},
        )


def event_name(model: str) -> str:
    """The name of a model's requests in Locust's stats: the model, and what the times in its row are."""
    return f"{model} (e2e)"


class GrpcStreamUser(StreamingLLMUser):
    """tritonclient gRPC: one bidirectional stream per request; Triton flags the final response."""

    protocol = "grpc"

    def on_start(self) -> None:
        self.client = grpcclient.InferenceServerClient(self.options.grpc_url or _default_grpc_url(self.host))
        try:
            config = self.client.get_model_config(self.model, as_json=True)["config"]
        except BaseException:
            self.on_stop()  # Locust calls on_stop only for users that started
            raise
        # NOTE: a model with max_batch_size > 0 (llm_dynamic) takes every input with a leading batch dimension.
        self.max_batch_size = int(config.get("max_batch_size", 0))
        super().on_start()

    def on_stop(self) -> None:
        # NOTE: drop the client now, while gevent runs: a client that is only garbage-collected at interpreter exit
        # closes its gRPC channel again there (tritonclient's __del__), and that can hang the process for good.
        client, self.client = self.client, None
        if client is not None:
            # NOTE: closed in a greenlet of its own, which the runner stopping this user cannot kill half-way (a
            # channel left half closed can hang the process at exit just the same).
            gevent.spawn(client.close).join()

    def stream(self, request: GenerationRequest, t0: float):
        stream = GrpcStream.start(self.client, self.model, build_inputs(request, self.max_batch_size),
                                  priority=request.priority)
        try:
            for chunk in stream.follow(self.options.request_timeout - (stream.sent_at - t0), from_start=True):
                # Timed from t0, as the HTTP user times its requests.
                yield dataclasses.replace(chunk, time_s=chunk.time_s + stream.sent_at - t0)
        except TimeoutError:
            raise StreamError("timeout: no final response within --request-timeout") from None
        finally:
            # A request that ended (its final response, or an error: our models end a request with it) has nothing
            # left to cancel.
            stream.close(cancel=not stream.final)
        if stream.exception is not None:
            raise StreamError(f"error: {stream.exception}")


class HttpStreamUser(StreamingLLMUser):
    """Triton's HTTP generate extension: POST /v2/models/<model>/generate_stream, one SSE event per response."""

    protocol = "http"

    def on_start(self) -> None:
        self.session = requests.Session()
        super().on_start()

    def on_stop(self) -> None:
        self.session.close()

    def url(self) -> str:
        return f"{self.host.rstrip('/')}/v2/models/{self.model}/generate_stream"

    def body(self, request: GenerationRequest) -> dict:
        return {name: values[0] for name, values in request.input_values().items()}

    def chunk(self, event: dict, time_s: float) -> Chunk:
        return parse_chunk(event.get, time_s)

    def error_text(self, body: str) -> str:
        return _error_text(body)

    def stream(self, request: GenerationRequest, t0: float):
        deadline = t0 + self.options.request_timeout
        try:
            with self.session.post(self.url(), json=self.body(request), stream=True,
                                   timeout=(5, self.options.request_timeout)) as r:
                if r.status_code != 200:
                    raise StreamError(f"error: HTTP {r.status_code}: {self.error_text(r.text)}")
                # chunk_size=None: each chunk as the server flushed it, so arrival times are the events' own.
                for line in r.iter_lines(chunk_size=None):
                    if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                        continue
                    t = time.perf_counter()
                    event = json.loads(line[5:])
                    if "error" in event:
                        raise StreamError(f"error: {self.error_text(json.dumps(event))}")
                    yield self.chunk(event, t - t0)
                    if t > deadline:
                        raise StreamError("timeout: stream still running after --request-timeout")
        except requests.RequestException as exc:
            raise StreamError(f"{type(exc).__name__}: {exc}") from None


class OpenAIStreamUser(HttpStreamUser):
    """The OpenAI-compatible frontend (frontend/openai/): POST /v1/completions with ``stream``, one SSE event per
    token, the usage chunk at the end; vLLM's ``ignore_eos`` as the other users send it."""

    protocol = "openai"
    # NOTE: the frontend sends one content chunk per token, but OpenAI's chunks carry no token ids: each chunk
    # stands for one token, also one whose text is still held back (part of a character).
    ONE_TOKEN = (0,)

    def url(self) -> str:
        return f"{(self.options.openai_url or _default_openai_url(self.host)).rstrip('/')}/v1/completions"

    def body(self, request: GenerationRequest) -> dict:
        return {"model": self.model, "prompt": request.text_input, "max_tokens": request.max_tokens,
                "temperature": request.temperature, "seed": request.seed, "ignore_eos": request.ignore_eos,
                "priority": openai_priority(request.priority or 0),
                "stream": True, "stream_options": {"include_usage": True}}

    def chunk(self, event: dict, time_s: float) -> Chunk:
        """A content chunk as one token; the finish chunk and the usage chunk as no token, with what they tell."""
        choice = event["choices"][0] if event["choices"] else {}
        usage = event.get("usage") or {}
        content = "finish_reason" in choice and choice["finish_reason"] is None
        return Chunk(
            text=choice.get("text") or "",
            output_ids=self.ONE_TOKEN if content else (),
            finish_reason=choice.get("finish_reason"),
            num_input_tokens=usage.get("prompt_tokens"),
            num_output_tokens=usage.get("completion_tokens"),
            time_s=time_s,
        )

    def error_text(self, body: str) -> str:
        """OpenAI's error body: keep just the message."""
        try:
            return json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return body.strip()[:300]


# NOTE: Locust runs every user class of a locustfile when the command line names none; this one needs the OpenAI
# frontend, so it runs only when named (`locust ... OpenAIStreamUser`, as loadtest/runner.py's --protocol openai does):
# Locust drops a class of weight 0 from its defaults.
OpenAIStreamUser.weight = 1 if "OpenAIStreamUser" in sys.argv else 0


def _error_text(body: str) -> str:
    """Triton answers a refused generate_stream with ``data: {"error": "..."}``; keep just the message."""
    text = body.strip().removeprefix("data:").strip()
    try:
        return json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return text[:300]


def _default_grpc_url(host: str | None) -> str:
    return f"{urlparse(host or 'http://127.0.0.1').hostname or '127.0.0.1'}:8001"


def _default_openai_url(host: str | None) -> str:
    return f"http://{urlparse(host or 'http://127.0.0.1').hostname or '127.0.0.1'}:9000"


def _default_metrics_url(host: str | None) -> str:
    return f"http://{urlparse(host or 'http://127.0.0.1').hostname or '127.0.0.1'}:8002/metrics"
