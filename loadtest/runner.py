"""Run one load point: a headless Locust subprocess against one model, with the metrics port sampled meanwhile.

Shared by ``loadtest.compare`` (a sweep per model) and ``loadtest.slo`` (step up until an SLO breaks). The server
is either started here through the launcher (``backend.triton.launcher.server.TritonServer``, on free 127.0.0.1
ports) or an already-running one given by URL.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlparse

from backend.contract.names import DYNAMIC
from backend.contract.settings import DEFAULT_MODEL
from backend.kernels.weight_format import WeightFormat
from backend.triton.launcher import config_text
from backend.triton.launcher.launch_options import free_ports
from frontend.openai.process import FrontendProcess
from loadtest import DEFAULT_SLO_TPOT_MS, DEFAULT_SLO_TTFT_MS
from loadtest.metrics import IDLE, MetricsSampler

REPO_ROOT = Path(__file__).resolve().parents[1]
LOCUSTFILE = REPO_ROOT / "loadtest" / "locustfile.py"
USER_CLASSES = {"grpc": "GrpcStreamUser", "http": "HttpStreamUser", "openai": "OpenAIStreamUser"}
# The weights a served model can run (--quantization): bf16 as shipped, or the engine's quantization formats.
# NOTE: listed here, not imported: a load test does not import the engine (tests/unit/test_quantization_options.py
# holds it equal to backend.engine.config.WEIGHT_FORMATS); their names are the kernels' (plain Python).
BF16 = WeightFormat.BF16
WEIGHT_FORMATS = (BF16, WeightFormat.Q4_1, WeightFormat.INT8)


@dataclass
class Target:
    """Where the server answers. ``server`` is the TritonServer this process started, if any."""

    http_url: str
    grpc_url: str
    metrics_url: str
    server: object = None
    model_folder: str = ""
    openai_url: str = ""  # the OpenAI frontend (--protocol openai)

    @property
    def server_pid(self) -> int | None:
        return getattr(self.server, "pid", None)

    @classmethod
    def from_url(cls, url: str, grpc_url: str | None = None, metrics_url: str | None = None) -> "Target":
        host = urlparse(url).hostname or "127.0.0.1"
        return cls(url.rstrip("/"), grpc_url or f"{host}:8001", metrics_url or f"http://{host}:8002/metrics")


@dataclass
class LoadPoint:
    """``users`` concurrent users; with ``arrival_rate`` > 0 they send Poisson arrivals at that rate (open loop)."""

    users: int
    arrival_rate: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.arrival_rate:g} req/s" if self.arrival_rate else f"{self.users} users"

    @property
    def slug(self) -> str:
        return f"r{self.arrival_rate:g}" if self.arrival_rate else f"u{self.users}"


@dataclass
class Plan:
    """How each load point runs (all bounded: time, requests, and the drain at the end)."""

    workload: str = "long_tailed"
    length_scale: float = 1.0
    run_s: float = 40.0
    ramp_s: float = 5.0
    max_requests: int = 2000
    stop_timeout_s: float = 60.0
    protocol: str = "grpc"
    seed: int = 0
    slo_ttft_ms: float = DEFAULT_SLO_TTFT_MS
    slo_tpot_ms: float = DEFAULT_SLO_TPOT_MS
    extra_locust_args: list = field(default_factory=list)
    # The mixed workload: interactive users beside each load point's users (batch users), and whether each request
    # is sent at its class's priority level.
    interactive_users: int = 0
    priorities: bool = False

    @property
    def is_mixed(self) -> bool:
        return self.workload == "mixed"


@contextlib.contextmanager
def serve(model_repository: Path, model_folder: str | None, log_path: Path, ready_timeout: float = 600.0):
    """Start tritonserver through the launcher on free 127.0.0.1 ports; stop it on exit."""
    from backend.triton.launcher.server import start_on_free_ports

    with start_on_free_ports(
        model_repository,
        model=model_folder,
        extra_args=["--exit-timeout-secs", "10"],
        log_path=log_path,
        ready_timeout=ready_timeout,
    ) as server:
        yield Target(server.http_url, server.grpc_url, server.metrics_url, server, str(server.model or ""))


def command_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """The parser of a load command (``make compare``, ``make slo``): ``doc``'s first paragraph as its description,
    the rest as its epilog, and the options that say which server to load: a running one (``--url``), or one
    started here."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=doc.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=doc.split("\n\n", 1)[1],
    )
    parser.add_argument("--url", default=None, help="use this running server (HTTP URL) instead of starting one")
    parser.add_argument("--grpc-url", default=None, help="host:port (default: --url's host, port 8001)")
    parser.add_argument("--metrics-url", default=None, help="default: http://<--url's host>:8002/metrics")
    parser.add_argument("--openai-url", default=None, help="the OpenAI frontend (default: http://<--url's host>:9000)")
    parser.add_argument("--model-repository", type=Path, default=REPO_ROOT / "model_repository")
    parser.add_argument(
        "--model",
        default=os.environ.get("MODEL") or None,
        help="HF model folder for a server started here (default: $MODEL, else the repository's own)",
    )
    parser.add_argument(
        "--quantization",
        choices=[str(f) for f in WEIGHT_FORMATS],
        default=None,
        help="the weights every served model runs: the engine parameter quantization, set in the served copies' "
        "configs (default: as the repository ships them, bf16)",
    )
    return parser


# The passes of each load point per --priorities: without priorities, with them, or the one and then the other.
PRIORITY_PASSES = {"off": (False,), "on": (True,), "both": (False, True)}


def add_mixed_arguments(parser: argparse.ArgumentParser) -> None:
    """The mixed workload's options of a load command (``make compare``, ``make slo``): how many interactive users
    stand beside each load point's batch users, and whether each class is sent at its priority level."""
    parser.add_argument(
        "--interactive-users", type=int, default=2,
        help="--workload mixed: interactive users per model at every load point, beside --users' batch users "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--priorities", choices=list(PRIORITY_PASSES), default="off",
        help="--workload mixed: send each class at its priority level (on), or run every load point without and "
        "with them (both); on and both serve the models with scheduling_policy priority (default: %(default)s)",
    )


def check_mixed_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what :func:`add_mixed_arguments`' options cannot mean with the rest of the command line."""
    if args.workload != "mixed" and args.priorities != "off":
        parser.error("--priorities sets the levels of the mixed workload's classes: use it with --workload mixed")
    if args.workload == "mixed" and args.rates:
        parser.error("--workload mixed is a closed loop (--users batch users beside --interactive-users); not --rates")
    if args.interactive_users < 0:
        parser.error("--interactive-users cannot be negative")


def engine_parameters(args: argparse.Namespace) -> dict[str, str]:
    """The engine parameters the command line sets on every served model (``--quantization``; ``--priorities``: the
    engine's ``scheduling_policy`` priority); {} when none."""
    parameters = {}
    quantization = getattr(args, "quantization", None)
    if quantization is not None:
        parameters["quantization"] = "none" if quantization == BF16 else quantization
    if getattr(args, "priorities", "off") != "off":
        parameters["scheduling_policy"] = "priority"
    return parameters


def weight_format(settings: dict) -> str:
    """The weights a model runs, from its :func:`batcher_settings`: the quantization, else its dtype (bf16 by
    default)."""
    quantization = (settings.get("quantization") or "").strip().lower()
    if quantization and quantization != "none":
        return quantization
    dtype = (settings.get("dtype") or "bfloat16").strip().lower()
    return BF16 if dtype in ("bfloat16", BF16) else dtype


@contextlib.contextmanager
def open_target(args: argparse.Namespace, log_path: Path, say=print):
    """The running server at ``args.url``, or one started here (and stopped on exit) when it is None; ``args`` has
    the server options of :func:`command_parser`."""
    if args.url:
        host = urlparse(args.url).hostname or "127.0.0.1"
        yield replace(Target.from_url(args.url, args.grpc_url, args.metrics_url),
                                  openai_url=getattr(args, "openai_url", None) or f"http://{host}:9000")
        return
    say(f"starting tritonserver on {args.model_repository} (log: {log_path}) ...")
    with serve(args.model_repository, args.model, log_path) as target:
        say(f"server ready: {target.http_url}")
        if getattr(args, "protocol", "grpc") != "openai":
            yield target
            return
        model_dir = args.model or target.model_folder or DEFAULT_MODEL
        with FrontendProcess(target.grpc_url, free_ports(1)[0], model_dir,
                             log_path=log_path.with_name("openai-frontend.log")) as frontend:
            say(f"OpenAI frontend ready: {frontend.url}")
            yield replace(target, openai_url=frontend.url)


@dataclass(frozen=True)
class DynamicVariant:
    """llm_dynamic served with other batcher settings: ``instances`` model instances (each its own engine, with the
    machine's cores split between them), ``max_batch_size`` seats each (and as many ``max_num_seqs``), and
    ``max_queue_delay_us``."""

    instances: int
    max_batch_size: int
    max_queue_delay_us: int

    @classmethod
    def parse(cls, spec: str) -> "DynamicVariant":
        match = re.fullmatch(r"\s*(\d+)x(\d+)@(\d+)\s*", spec)
        if match is None:
            raise ValueError(
                f"dynamic variant {spec!r}: expected INSTANCESxMAX_BATCH_SIZE@MAX_QUEUE_DELAY_US, e.g. 2x4@2000"
            )
        variant = cls(*map(int, match.groups()))
        if variant.instances < 1 or variant.max_batch_size < 1:
            raise ValueError(f"dynamic variant {spec!r}: instances and max_batch_size must be at least 1")
        return variant

    @property
    def name(self) -> str:
        return f"{DYNAMIC}_{self.instances}x{self.max_batch_size}_{self.max_queue_delay_us}us"

    def write(self, source: Path, dst: Path, parameters: Mapping[str, str] | None = None) -> None:
        """The model folder ``dst/<name>``: a copy of ``source/llm_dynamic`` with these settings (and the engine
        ``parameters`` given)."""
        from backend.triton.launcher.launch_options import copy_model_repository

        threads = max(1, (os.cpu_count() or 1) // self.instances)
        parameters = {**(parameters or {}), "max_num_seqs": str(self.max_batch_size)}
        if self.instances > 1:  # NOTE: one instance takes every core (the engine's default); several share them
            parameters["num_threads"] = str(threads)
        copy_model_repository(dst / "staging", [DYNAMIC], parameters, source=source)
        folder = dst / "staging" / DYNAMIC
        with config_text.edit(folder / "config.pbtxt") as config:
            config.name = self.name
            config_text.set_max_batch_size(config, self.max_batch_size)
            config_text.set_instance_count(config, self.instances)
            config_text.dynamic_batching(config).max_queue_delay_microseconds = self.max_queue_delay_us
        folder.rename(dst / self.name)
        (dst / "staging").rmdir()


def served_repository(
    source: Path,
    dst: Path,
    models: list[str],
    variants: list[DynamicVariant],
    parameters: Mapping[str, str] | None = None,
) -> Path:
    """``dst`` holding the compared models: copies of ``source``'s and the variants of llm_dynamic, every one with
    the engine ``parameters`` given (e.g. :func:`engine_parameters`)."""
    from backend.triton.launcher.launch_options import copy_model_repository

    names = {v.name for v in variants}
    copy_model_repository(dst, [m for m in models if m not in names], parameters, source=source)
    for variant in variants:
        if variant.name in models:
            variant.write(source, dst, parameters)
    return dst


def repository_to_serve(args: argparse.Namespace, out_dir: Path, models: list[str]) -> Path:
    """What a load command serves: ``--model-repository`` as it is, or, when the command line asks for llm_dynamic's
    variants (``args.variants``) or engine parameters (``--quantization``), :func:`served_repository`'s copy of
    ``models`` in ``out_dir/model_repository``."""
    variants, parameters = getattr(args, "variants", []), engine_parameters(args)
    if not variants and not parameters:
        return args.model_repository
    return served_repository(args.model_repository, out_dir / "model_repository", models, variants, parameters)


# ---- talking to the server outside Locust ------------------------------------------------------------------


def http_json(url: str, body: dict | None = None, timeout: float = 30.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"{}")


def check_models(target: Target, models: list[str]) -> dict[str, dict]:
    """Each model's config; raises RuntimeError naming what the server does serve when one is missing."""
    configs = {}
    for model in models:
        try:
            configs[model] = http_json(f"{target.http_url}/v2/models/{model}/config")
        except (urllib.error.URLError, OSError) as exc:
            try:
                index = http_json(f"{target.http_url}/v2/repository/index", {})
                served = ", ".join(m["name"] for m in index if m.get("state") == "READY") or "none"
            except (urllib.error.URLError, OSError, ValueError):
                served = "unknown: the server does not answer"
            raise RuntimeError(f"model {model!r} is not ready at {target.http_url} ({exc}); served: {served}") from None
    return configs


def warm_up(target: Target, model: str, concurrency: int = 8, max_tokens: int = 8, timeout: float = 120.0) -> float:
    """Two rounds of ``concurrency`` short requests, so lazy initialisation is not measured; return seconds taken."""
    url = f"{target.http_url}/v2/models/{model}/generate"
    t0 = time.perf_counter()

    def one(i: int) -> None:
        http_json(
            url, {"text_input": f"warm up request number {i}", "max_tokens": max_tokens, "ignore_eos": True}, timeout
        )

    with ThreadPoolExecutor(concurrency) as pool:
        for _ in range(2):
            list(pool.map(one, range(concurrency)))
    return time.perf_counter() - t0


def served_parameter(config: dict, key: str) -> str | None:
    """The string parameter ``key`` of a config as the server serves it (``/v2/models/<m>/config``); None when
    unset."""
    return config.get("parameters", {}).get(key, {}).get("string_value")


def max_num_seqs(config: dict) -> int | None:
    value = served_parameter(config, "max_num_seqs")
    return int(value) if value and value.isdigit() else None


def batcher_settings(config: dict) -> dict:
    """Every setting that decides a model's batch, from the config the server serves (``/v2/models/<m>/config``):
    Triton's batcher (max_batch_size, preferred_batch_size, max_queue_delay_microseconds, instance count) and the
    engine's (max_num_seqs, max_num_batched_tokens, the KV pool as configured), and the weights it runs (dtype,
    quantization). None where a setting is not set."""
    dynamic = config.get("dynamic_batching")
    sequence = config.get("sequence_batching")
    if dynamic is not None:
        batcher = "dynamic"
    elif sequence is not None:
        batcher = "sequence (iterative)" if sequence.get("iterative_sequence") else "sequence"
        dynamic = sequence.get("oldest")  # the sequence batcher's "oldest" strategy batches like the dynamic one
    else:
        batcher = "none: the model's own loop"
    # NOTE: Triton completes a served config: a dynamic batcher shipped without preferred_batch_size is served with
    # [max_batch_size], which is why these come from the server and not from config.pbtxt.
    queue_delay = (dynamic or {}).get("max_queue_delay_microseconds")
    parameters = {key: value.get("string_value") for key, value in config.get("parameters", {}).items()}
    return {
        "batcher": batcher,
        "max_batch_size": config.get("max_batch_size"),
        "preferred_batch_size": (dynamic or {}).get("preferred_batch_size") or None,
        "max_queue_delay_microseconds": int(queue_delay) if queue_delay is not None else None,
        "instance_count": sum(int(group.get("count", 1)) for group in config.get("instance_group", [])) or None,
        "max_num_seqs": parameters.get("max_num_seqs"),
        "max_num_batched_tokens": parameters.get("max_num_batched_tokens"),
        "num_kv_blocks": parameters.get("num_kv_blocks"),
        "kv_cache_memory_bytes": parameters.get("kv_cache_memory_bytes"),
        "dtype": parameters.get("dtype"),
        "quantization": parameters.get("quantization"),
        "scheduling_policy": parameters.get("scheduling_policy"),
    }


# ---- one load point -----------------------------------------------------------------------------------------


def locust_command(
    target: Target, model: str, point: LoadPoint, plan: Plan, records: Path, csv_prefix: Path
) -> list[str]:
    users = point.users + plan.interactive_users
    mixed = ["--interactive-users", str(plan.interactive_users), *(["--priorities"] if plan.priorities else [])]
    return [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
        "-u", str(users), "-r", str(users),
        "--run-time", f"{plan.run_s:g}s", "--stop-timeout", f"{plan.stop_timeout_s:g}",
        "--csv", str(csv_prefix), "--exit-code-on-error", "0",
        "--host", target.http_url, "--grpc-url", target.grpc_url, "--model", model,
        *(["--openai-url", target.openai_url] if target.openai_url else []),
        "--workload", plan.workload, "--length-scale", f"{plan.length_scale:g}", "--seed", str(plan.seed),
        "--slo-ttft-ms", f"{plan.slo_ttft_ms:g}", "--slo-tpot-ms", f"{plan.slo_tpot_ms:g}",
        "--arrival-rate", f"{point.arrival_rate:g}", "--max-requests", str(plan.max_requests),
        "--records-file", str(records), *(mixed if plan.is_mixed else []), *plan.extra_locust_args,
        USER_CLASSES[plan.protocol],
    ]  # fmt: skip


def run_load_point(target: Target, model: str, point: LoadPoint, plan: Plan, out_dir: Path,
                   idle_pids: Mapping[str, int] | None = None) -> dict:
    """Drive ``model`` at ``point`` with headless Locust; return the raw run (records, metrics, window). In the mixed
    workload the point's users are batch users, beside ``plan.interactive_users`` interactive ones. ``idle_pids``:
    other servers meant to sit idle meanwhile, by name; their CPU is sampled too (as ``idle <name>``)."""
    name = f"{model}_{point.slug}{'_priorities' if plan.priorities else ''}"
    (out_dir / "locust").mkdir(parents=True, exist_ok=True)
    records_path = out_dir / "locust" / f"{name}_requests.jsonl"
    records_path.unlink(missing_ok=True)
    log_path = out_dir / "locust" / f"{name}.log"
    command = locust_command(target, model, point, plan, records_path, out_dir / "locust" / name)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}

    load_before = os.getloadavg()
    pids = {"server": target.server_pid, **{f"{IDLE}{name}": pid for name, pid in (idle_pids or {}).items()}}
    sampler = MetricsSampler(target.metrics_url, model, interval=0.5, pids=pids).start()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)
        sampler.watch("loadgen", process.pid)
        returncode = _wait_bounded(process, plan.run_s + plan.stop_timeout_s + 60)
    samples = sampler.stop()

    requests, events = read_records(records_path)
    run = {
        "model": model,
        "users": point.users,
        "arrival_rate": point.arrival_rate,
        "load": point.label,
        **({"interactive_users": plan.interactive_users, "priorities": plan.priorities} if plan.is_mixed else {}),
        "requests": requests,
        "events": events,
        "metrics": samples,
        "metrics_errors": sampler.errors,
        "locust_returncode": returncode,
        "locust_log": str(log_path.relative_to(out_dir)),
        "locust_csv": str((out_dir / "locust" / name).relative_to(out_dir)) + "_stats.csv",
        "loadavg_before": load_before,
        "window": measurement_window(events, plan.ramp_s),
    }
    if run["window"] is None:
        tail = log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"Locust did not run {name} (exit {returncode}); its log ends:\n{tail}")
    return run


def _wait_bounded(process: subprocess.Popen, timeout_s: float, grace_s: float = 30.0) -> int:
    """Locust's exit status, however it ends: past ``timeout_s`` it is asked to stop (SIGTERM), past ``grace_s``
    more it is killed. NOTE: Locust has been seen to print its summary and then hang at interpreter exit, on a gRPC
    channel of a user stopped mid-stream; every request it finished is in the records file already, so the load point
    is read from there and the run goes on rather than leave a process behind."""
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.terminate()
    try:
        return process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def read_records(path: Path) -> tuple[list[dict], list[dict]]:
    requests, events = [], []
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                (events if "event" in record else requests).append(record)
    return requests, events


def measurement_window(events: list[dict], ramp_s: float) -> tuple[float, float] | None:
    """From ``ramp_s`` after the test started to when it stopped issuing requests."""
    starts = [e["t"] for e in events if e["event"] == "test_start"]
    stops = [e["t"] for e in events if e["event"] in ("stop_issuing", "test_stop")]
    if not starts or not stops:
        return None
    start, end = starts[0], min(stops)
    return (min(start + ramp_s, end), end)
