"""Cancel storm: many streamed requests, each dropped by its client mid-answer, against a real server; how many the
server lost, whether it crashed or hung, how long it took to come back, and whether it let go of everything after.

    python -m loadtest.storm [--protocol grpc|openai] [--requests 20000] [--clients 8] [--models M,...]
                             [--max-tokens 64] [--max-chunks 8] [--model DIR] [--out DIR] [--keep | --no-keep]

It starts its own server (``loadtest/served.py``: free 127.0.0.1 ports; with ``--protocol openai`` the OpenAI
frontend beside it). ``--clients`` threads then send ``--requests`` requests in all, the models by turns: each a
stream of ``--max-tokens`` tokens (greedy, ``ignore_eos``) that its client leaves after 0 to ``--max-chunks``
chunks: over Triton gRPC by cancelling its stream (``stop_stream(cancel_requests=True)``, as the soak's
``cancel_mid_stream``), over OpenAI by closing the HTTP stream (the ``openai`` SDK's stream, as the soak's
``openai_stream_disconnect``). None is sent once ``--duration-limit`` has passed.

Every request is *disconnected* (its client left after the chunks it wanted), *completed* (the whole answer came
first), an *error* that says why (as the soak reads errors: overloaded), *ended by the server's fall* (an error or a
silence while tritonserver crashed or hung), or *lost*: neither its chunks nor a final response nor a clean error
within ``--request-timeout``. Meanwhile it watches tritonserver as the launcher does (``backend/triton/launcher/
watchdog.py``): a process that died is a crash (its site from the stack it printed, ``crash.py``); ``/v2/health/live``
or the metrics port silent for ``--hang-timeout`` is a hang, and a model whose queue does not move for
``--stall-timeout`` a stall; a hung or stalled server is killed. Either way the clients wait while it starts again on
the same ports (as ``make serve`` does), and the recovery time is kept. At the end every model must be back to
nothing pending in Triton and no KV block in use, and SIGTERM must stop the server with status 0.

Writes ``storm.json`` and the run's ``record.json`` under ``--out`` (default ``reports/storm-<protocol>-<time>/``);
the record of a full storm (``--requests`` 20,000 or more on the default models; ``--keep`` keeps a smaller one too)
is kept as ``records/runs/storm-<protocol>-<cpu>.json``, from which ``make tables`` writes docs/server.md's storm
table. Exits 1 unless no request was lost, the server neither crashed nor hung, and it let go of everything.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import queue
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from backend.contract.names import CONTINUOUS, DYNAMIC, ITERATIVE, KV_BLOCKS_USED, MODELS, PENDING_REQUESTS
from backend.triton.launcher import crash, watchdog
from client.grpc_stream import start_stream
from loadtest.served import Served, add_served_args, settle
from loadtest.soak import names_list
from loadtest.soak_patterns import WORDS, Budget, error_outcome, openai_error_outcome
from loadtest.soak_report import load_average
from records.provenance import cpu, cpu_slug
from records.record import RUNS, Column, Record

REPO_ROOT = Path(__file__).resolve().parents[1]
PROTOCOLS = ("grpc", "openai")
DEFAULT_MODELS = [CONTINUOUS, ITERATIVE, DYNAMIC]
FULL_REQUESTS = 20_000
OUTCOMES = ("disconnected", "completed", "errors", "server_fell", "lost")
FALL_GRACE_S = 3.0  # how long a client that saw its connection break waits to learn whether the server fell
PROGRESS_EVERY_S = 30.0


class Ledger:
    """Every request's outcome, by model; errors by reason, lost ones with theirs (the first 50)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_model: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.errors: collections.Counter = collections.Counter()
        self.lost: list[str] = []
        self.sent = 0

    def add(self, model: str, outcome: str, reason: str = "") -> None:
        with self.lock:
            self.by_model[model][outcome] += 1
            if outcome == "errors":
                self.errors[reason] += 1
            elif outcome == "lost" and len(self.lost) < 50:
                self.lost.append(f"{model}: {reason[:300]}")

    def totals(self) -> dict[str, int]:
        with self.lock:
            return {k: sum(c[k] for c in self.by_model.values()) for k in OUTCOMES}


@dataclass
class Incident:
    """tritonserver crashed, hung or stalled (or the frontend died), and was started again."""

    kind: str  # crash, hang, stall, frontend exit
    at_s: float  # seconds into the storm
    after_requests: int  # requests sent before it
    detail: str  # the signal and the crash site, or what hung
    known_frontend_crash: bool
    recovery_s: float | None  # from noticing it to the server (and frontend) ready again; None: not back


class Storm:
    def __init__(self, served: Served, args) -> None:
        self.served, self.args = served, args
        self.ledger = Ledger()
        self.budget = Budget(args.requests, args.duration_limit)
        self.up = threading.Event()  # set while the server serves: clients wait on it
        self.up.set()
        self.done = threading.Event()  # the clients are done: the monitor stops
        self.failed: str | None = None  # the server could not be brought back: the clients stop
        self.epoch = 0  # restarts so far: a request that spans one was caught in a fall
        self.incidents: list[Incident] = []
        self.falls: queue.Queue = queue.Queue()  # (kind, what ended it, an event set once it is handled)
        self.loads: list[float] = []  # the machine's 1-minute load average, every second
        self.t0 = time.monotonic()
        self._numbers = itertools.count()

    # -- the clients

    def next_request(self) -> tuple[int, str] | None:
        """The next request's number and model (the models by turns), once the server serves; None when the budget
        is spent or the server is gone for good."""
        while not self.up.wait(1.0):
            if self.failed:
                return None
        if self.failed or not self.budget.take():
            return None
        number = next(self._numbers)
        with self.ledger.lock:
            self.ledger.sent += 1
        return number, self.args.models[number % len(self.args.models)]

    def client(self, index: int) -> None:
        rng = random.Random(f"{self.args.seed}:{index}")
        send = self.grpc_request if self.args.protocol == "grpc" else self.openai_request
        sdk = self.openai_sdk() if self.args.protocol == "openai" else None
        try:
            while (taken := self.next_request()) is not None:
                _, model = taken
                prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))
                epoch = self.epoch
                try:
                    outcome, reason = send(sdk, model, prompt, rng.randint(0, self.args.max_chunks))
                except Exception as exc:  # the client library's own failure: a broken connection, most likely
                    outcome, reason = "lost", f"client: {type(exc).__name__}: {exc}"
                if outcome == "lost" and self.fell_since(epoch):
                    outcome = "server_fell"
                self.ledger.add(model, outcome, reason)
                if outcome == "server_fell":  # no request to a fallen server: it would only fall too
                    self.await_recovery(epoch)
        finally:
            if sdk is not None:
                sdk.close()

    def fell_since(self, epoch: int) -> bool:
        """Whether the server fell (crashed, hung, was restarted) since ``epoch``, waiting briefly for the monitor
        to notice a fall that just broke this client's connection."""
        deadline = time.monotonic() + FALL_GRACE_S
        while time.monotonic() < deadline:
            if self.epoch != epoch or not self.up.is_set() or not self.served.is_running:
                return True
            time.sleep(0.1)
        return False

    def await_recovery(self, epoch: int) -> None:
        """Until the monitor has started the server again after the fall that ended a request sent in ``epoch`` (or
        has given up)."""
        while self.epoch == epoch and not self.failed:
            time.sleep(0.1)

    def grpc_request(self, _sdk, model: str, prompt: str, num_chunks: int) -> tuple[str, str]:
        """A stream cancelled (``stop_stream(cancel_requests=True)``) once ``num_chunks`` chunks have come."""
        args = self.args
        stream = start_stream(self.served.grpc_url, model, prompt, max_tokens=args.max_tokens, ignore_eos=True,
                              temperature=0.0, stream=True)
        try:
            arrived = stream.wait_tokens(num_chunks, args.request_timeout)
            if stream.final:  # it ended before its client left: the whole answer, or an error
                if stream.error is not None:
                    return clean_error(error_outcome(stream.error))
                if len(stream.token_ids) == args.max_tokens:
                    return "completed", ""
                return "lost", f"the stream ended after {len(stream.token_ids)} of {args.max_tokens} tokens"
            if arrived:
                stream.cancel()
                return "disconnected", ""
            return "lost", f"{len(stream.chunks)} of {num_chunks} chunks within {args.request_timeout:g} s"
        finally:
            stream.close(cancel=not stream.final)

    def openai_sdk(self):
        import openai  # NOTE: here, not at the top: only --protocol openai needs the SDK

        return openai.OpenAI(base_url=f"{self.served.openai_url}/v1", api_key="unused", max_retries=0,
                             timeout=self.args.request_timeout)

    def openai_request(self, sdk, model: str, prompt: str, num_chunks: int) -> tuple[str, str]:
        """A completion streamed from the OpenAI frontend, its HTTP stream closed once ``num_chunks`` chunks have
        come."""
        import openai

        args = self.args
        try:
            stream = sdk.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens, temperature=0.0,
                                            stream=True, extra_body={"ignore_eos": True})
            with stream:  # leaving the block closes the connection
                chunks = list(itertools.islice(stream, num_chunks))
                if len(chunks) == num_chunks:
                    return "disconnected", ""
                finish_reason = chunks[-1].choices[0].finish_reason if chunks and chunks[-1].choices else None
                if finish_reason == "length":  # the whole answer came in fewer chunks
                    return "completed", ""
                return "lost", f"the stream ended after {len(chunks)} of {num_chunks} chunks ({finish_reason})"
        except openai.APITimeoutError:
            return "lost", f"no chunk within {args.request_timeout:g} s"
        except openai.APIConnectionError as exc:
            return "lost", f"connection: {exc}"
        except openai.APIError as exc:  # a refusal (429: overloaded), or an error event in the stream
            return clean_error(openai_error_outcome(exc))

    # -- the monitor

    def monitor(self) -> None:
        """Watch the server until the clients are done; hand each fall (a crash, a hang, a stall) to the thread that
        runs the storm, which starts the server again, and watch the new one."""
        args = self.args
        while not self.failed:
            server = self.served.server
            probes_done = threading.Event()
            probes = watchdog.probe_liveness(server.liveness_urls(), args.hang_timeout, probes_done)
            stalls = watchdog.Watchdog(args.stall_timeout)
            try:
                kind, ended = self.watch(server, probes, stalls)
            finally:
                probes_done.set()
            if kind is None:
                return
            handled = threading.Event()
            self.falls.put((kind, ended, handled))
            handled.wait()

    def watch(self, server, probes, stalls) -> tuple[str | None, list]:
        """Until ``server`` falls (its kind, and the hangs or stalls that ended it) or the clients are done with it
        still up (None)."""
        while True:
            done = self.done.wait(watchdog.INTERVAL_S)
            now = time.monotonic()
            if not server.is_running:
                return "crash", []
            ended = [hang for probe in probes if (hang := probe.hang(now)) is not None]
            kind = "hang"
            if not ended and self.args.stall_timeout > 0:
                ended, kind = stalls.poll(server.metrics_url), "stall"
            if ended:
                server.kill()  # every call it held ends now, with an error
                return kind, ended
            frontend = self.served.frontend
            if frontend is not None and frontend.process.poll() is not None:
                return "frontend exit", []
            if done:
                return None, []

    def recover(self, kind: str, ended: list, restart: bool = True) -> None:
        noticed = time.monotonic()
        self.up.clear()
        server = self.served.server
        if kind == "crash":
            try:
                server.wait(timeout=10)  # a crashing server may still be writing its stack
            except Exception:
                pass
            site = self.served.crash_site()
            detail = f"exit status {server.returncode}" + (f" in {site}" if site else "")
            known = crash.is_known_frontend_crash(site)
        elif kind == "frontend exit":
            detail, known = f"the OpenAI frontend exited {self.served.frontend.process.returncode}", False
        else:
            detail, known = "; ".join(map(str, ended)), False
        print(f"[storm] {kind} after {self.ledger.sent} requests: {detail}"
              + ("; starting it again" if restart else ", after the last request"), flush=True)
        incident = Incident(kind, round(noticed - self.t0, 1), self.ledger.sent, detail, known, None)
        self.incidents.append(incident)
        if not restart:
            self.failed = f"{kind} after the last request"
            return
        if len(self.incidents) > self.args.max_restarts:
            self.failed = f"more than {self.args.max_restarts} restarts"
            return
        try:
            if kind == "frontend exit":
                self.served.restart_frontend()
            else:
                self.served.restart()
        except Exception as exc:
            self.failed = f"the server did not come back: {exc}"
            print(f"[storm] {self.failed}", flush=True)
            return
        incident.recovery_s = round(time.monotonic() - noticed, 1)
        print(f"[storm] back after {incident.recovery_s} s", flush=True)
        self.epoch += 1
        self.up.set()

    # -- the run

    def run(self) -> float:
        threads = [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(self.args.clients)]
        monitor = threading.Thread(target=self.monitor, daemon=True)
        monitor.start()
        for thread in threads:
            thread.start()
        join_by = self.t0 + self.args.duration_limit + 2 * self.args.request_timeout + 60
        last_print = time.monotonic()
        while any(thread.is_alive() for thread in threads) and time.monotonic() < join_by:
            self.handle_falls(restart=True)
            self.loads.append(os.getloadavg()[0])
            if time.monotonic() - last_print >= PROGRESS_EVERY_S:
                last_print = time.monotonic()
                print(f"[storm] {self.progress()}", flush=True)
        seconds = time.monotonic() - self.t0
        self.done.set()
        while monitor.is_alive():  # a fall it notices now is noted, and the server left as it fell
            self.handle_falls(restart=False)
        self.clients_still_running = sum(thread.is_alive() for thread in threads)
        return seconds

    def handle_falls(self, restart: bool) -> None:
        """Wait a second for a fall the monitor noticed, and recover from it here.

        NOTE: here, on the thread that runs the storm and outlives the server: a tritonserver gets SIGTERM when the
        thread that started it ends (PR_SET_PDEATHSIG, backend/triton/launcher/server.py)."""
        try:
            kind, ended, handled = self.falls.get(timeout=1.0)
        except queue.Empty:
            return
        try:
            self.recover(kind, ended, restart=restart)
        finally:
            handled.set()

    def progress(self) -> str:
        elapsed = time.monotonic() - self.t0
        rate = self.ledger.sent / elapsed if elapsed else 0.0
        return (f"{self.ledger.sent:,} of {self.args.requests:,} sent in {elapsed:.0f} s ({rate:.1f} req/s), "
                f"{len(self.incidents)} crashes or hangs; outcomes so far {self.ledger.totals()}")


def clean_error(outcome: tuple[str, str]) -> tuple[str, str]:
    """The soak's reading of an error (``soak_patterns``: overloaded is clean, anything else lost) in this ledger's
    words."""
    return ("errors", outcome[1]) if outcome[0] == "error" else outcome


# ---- the report and the record ----------------------------------------------------------------------------------

STORM_COLUMNS = [
    Column("protocol"), Column("models"), Column("requests"), Column("disconnected"), Column("completed"),
    Column("errors"), Column("server_fell", "ended by a fall"), Column("lost"), Column("crashes"),
    Column("hangs", "hangs or stalls"), Column("crash_rate", "crashes per cancellation"),
    Column("recovery_s", "recovery s (max)", "{:.1f}"), Column("pending_after", "pending after", "{:g}"),
    Column("kv_after", "KV blocks after", "{:g}"), Column("exit_status", "exit status"),
    Column("forced", "forced unload"),
    Column("req_per_s", "req/s", "{:.1f}"), Column("seconds", "seconds", "{:.0f}"),
    Column("load_mean", "load average (mean)", "{:.1f}"), Column("cpus", "CPUs"),
]
INCIDENT_COLUMNS = [
    Column("kind"), Column("at_s", "at s", "{:.0f}"), Column("after_requests", "after requests"), Column("detail"),
    Column("known_frontend_crash", "Triton 2.51's known gRPC race"),  # triton_workarounds.GRPC_CANCEL_RACE
    Column("recovery_s", "recovery s", "{:.1f}"),
]
MODEL_COLUMNS = [Column("model"), Column("requests"), *(Column(k) for k in OUTCOMES),
                 Column("pending_after", "pending after", "{:g}"), Column("kv_after", "KV blocks after", "{:g}")]


def crash_rate(num_crashes: int, num_cancelled: int) -> str:
    """'1 in 4,120' cancellations, or 'none in 20,000'."""
    if num_crashes == 0:
        return f"none in {num_cancelled:,}"
    return f"1 in {round(num_cancelled / num_crashes):,}"


def storm_row(report: dict) -> dict:
    totals, incidents, stop = report["outcomes"], report["incidents"], report["stop"]
    after = report["after"]
    recoveries = [i["recovery_s"] for i in incidents if i["recovery_s"] is not None]
    return {
        "protocol": report["protocol"], "models": ", ".join(report["models"]), "requests": report["requests"],
        **totals,
        "crashes": sum(i["kind"] == "crash" for i in incidents),
        "hangs": sum(i["kind"] in ("hang", "stall") for i in incidents),
        "crash_rate": crash_rate(sum(i["kind"] == "crash" for i in incidents), totals["disconnected"]),
        "recovery_s": max(recoveries) if recoveries else None,
        "pending_after": sum(g.get(PENDING_REQUESTS, float("nan")) for g in after.values()),
        "kv_after": sum(g.get(KV_BLOCKS_USED, float("nan")) for g in after.values()),
        "exit_status": stop["exit_status"], "forced": ", ".join(stop["forced_models"]) or "none",
        "req_per_s": report["req_per_s"], "seconds": report["duration_s"],
        **{key: report.get("load_average", {}).get(key) for key in ("load_mean", "cpus")},
    }


def model_rows(report: dict) -> list[dict]:
    return [{"model": model, "requests": sum(counts.values()), **{k: counts.get(k, 0) for k in OUTCOMES},
             "pending_after": report["after"].get(model, {}).get(PENDING_REQUESTS),
             "kv_after": report["after"].get(model, {}).get(KV_BLOCKS_USED)}
            for model, counts in report["by_model"].items()]


def verdict(report: dict) -> dict[str, bool]:
    totals = report["outcomes"]
    return {
        "every_request_accounted_for": sum(totals.values()) == report["requests"]
        and report["clients_still_running"] == 0,
        "no_request_lost": totals["lost"] == 0,
        "no_crash": not any(i["kind"] == "crash" for i in report["incidents"]),
        "no_hang": not any(i["kind"] in ("hang", "stall") for i in report["incidents"]),
        "nothing_pending_and_no_kv_block_after": all(
            g.get(PENDING_REQUESTS) == 0 and g.get(KV_BLOCKS_USED) == 0 for g in report["after"].values()),
        "sigterm_exit_0": report["stop"]["exit_status"] == 0,
    }


def summary(report: dict) -> str:
    row = storm_row(report)
    lines = [
        f"storm ({report['protocol']}): {report['requests']:,} requests in {report['duration_s']:.0f} s "
        f"({report['req_per_s']:.1f} req/s) on {', '.join(report['models'])}, {report['clients']} clients",
        "  " + ", ".join(f"{k} {row[k]}" for k in OUTCOMES),
        f"  crashes {row['crashes']}, hangs or stalls {row['hangs']} (crashes per cancellation: {row['crash_rate']})",
    ]
    lines += [f"  {i['kind']} at {i['at_s']:.0f} s after {i['after_requests']} requests: {i['detail']}; back after "
              f"{i['recovery_s']} s" for i in report["incidents"]]
    if report["error_reasons"]:
        lines.append("  errors by reason: " + ", ".join(f"{k} {v}" for k, v in sorted(report["error_reasons"].items())))
    lines += [f"  lost: {reason}" for reason in report["lost_reasons"][:10]]
    lines.append(f"  after: pending {row['pending_after']:g}, KV blocks {row['kv_after']:g}; SIGTERM: exit status "
                 f"{row['exit_status']}, forced unload: {row['forced']}")
    lines += [f"  {'ok  ' if ok else 'FAIL'} {name}" for name, ok in report["checks"].items()]
    return "\n".join(lines)


def kept_rate(protocol: str, runs: Path = RUNS) -> tuple[float, str] | None:
    """Requests per second of the kept storm record of this protocol (this CPU's first), and its file name."""
    own = runs / f"storm-{protocol}-{cpu_slug(cpu())}.json"
    for path in [own] if own.exists() else sorted(runs.glob(f"storm-{protocol}-*.json")):
        try:
            rows = Record.read(path).tables["storm"].rows
            return float(rows[0]["req_per_s"]), path.name
        except (OSError, KeyError, IndexError, TypeError, ValueError):
            continue
    return None


# ---- the command line -----------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.storm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--protocol", choices=PROTOCOLS, default="grpc",
                        help="grpc: cancel the stream; openai: close the HTTP stream of the OpenAI frontend")
    parser.add_argument("--requests", type=int, default=FULL_REQUESTS, help="requests in all (default: %(default)s)")
    parser.add_argument("--clients", type=int, default=8, help="clients at once (default: %(default)s)")
    parser.add_argument("--models", type=names_list(MODELS), default=DEFAULT_MODELS,
                        help=f"comma-separated, sent to by turns (default: {','.join(DEFAULT_MODELS)})")
    parser.add_argument("--max-tokens", type=int, default=64, help="each request's max_tokens (default: %(default)s)")
    parser.add_argument("--max-chunks", type=int, default=8,
                        help="a client leaves after 0 to this many chunks (default: %(default)s)")
    parser.add_argument("--duration-limit", type=float, default=3 * 3600.0,
                        help="seconds after which no request is sent (default: %(default)s)")
    parser.add_argument("--request-timeout", type=float, default=60.0,
                        help="seconds a request may take to its chunks or final response (default: %(default)s)")
    parser.add_argument("--hang-timeout", type=float, default=watchdog.HANG_TIMEOUT_S,
                        help="tritonserver's health or metrics silent this long is a hang (default: %(default)s)")
    parser.add_argument("--stall-timeout", type=float, default=watchdog.STALL_TIMEOUT_S,
                        help="a model's queue not moving this long is a stall; 0: not watched (default: %(default)s)")
    parser.add_argument("--max-restarts", type=int, default=20, help="restarts before the storm gives up")
    parser.add_argument("--settle-timeout", type=float, default=30.0,
                        help="seconds the models may take to be idle after the storm (default: %(default)s)")
    add_served_args(parser)  # --model, --model-repository, --exit-timeout, --server-arg
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="report folder (default: reports/storm-<protocol>-<time>)")
    parser.add_argument("--keep", action=argparse.BooleanOptionalAction, default=None,
                        help="keep the record as records/runs/storm-<protocol>-<cpu>.json (default: a full storm's)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out) if args.out else REPO_ROOT / "reports" / time.strftime(f"storm-{args.protocol}-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    full = args.requests >= FULL_REQUESTS and set(args.models) >= set(DEFAULT_MODELS)
    record = Record.start("make storm", {**vars(args), "full_storm": full}, measure_bandwidth=False)
    known = kept_rate(args.protocol)
    print(f"[storm] {args.requests:,} requests over {args.protocol}, {args.clients} clients, on "
          f"{', '.join(args.models)}" + (f"; expected about {args.requests / known[0] / 60:.0f} min at the "
                                        f"{known[0]:.1f} req/s of {known[1]}" if known else ""), flush=True)
    served = Served.from_args(args, out=out, openai=args.protocol == "openai", name="storm")
    try:
        ready_s = served.start()
        print(f"[storm] server ready in {ready_s:.1f} s", flush=True)
        storm = Storm(served, args)
        seconds = storm.run()
        settled = settle(served.metrics_url, args.models, args.settle_timeout, lambda: served.is_running) \
            if served.is_running else {"gauges": {m: {} for m in args.models}, "seconds": None}
    finally:
        stopped = served.stop()
    ledger = storm.ledger
    report = {
        "protocol": args.protocol, "models": args.models, "clients": args.clients, "requests": ledger.sent,
        "duration_s": round(seconds, 1), "req_per_s": round(ledger.sent / seconds, 2) if seconds else None,
        "outcomes": ledger.totals(), "by_model": {m: dict(c) for m, c in ledger.by_model.items()},
        "error_reasons": dict(ledger.errors), "lost_reasons": ledger.lost,
        "clients_still_running": storm.clients_still_running, "gave_up": storm.failed,
        "incidents": [asdict(i) for i in storm.incidents],
        "after": settled["gauges"], "settled_after_s": settled["seconds"],
        "stop": asdict(stopped), "server_ready_s": round(ready_s, 1),
        "load_average": load_average(storm.loads),
    }
    if stopped.exit_status not in (0, None):
        report["stop_crash_site"] = served.crash_site()
    report["checks"] = verdict(report)
    report["ok"] = all(report["checks"].values())
    (out / "storm.json").write_text(json.dumps(report, indent=1) + "\n")
    record.add_table("storm", STORM_COLUMNS, [storm_row(report)])
    record.add_table("models", MODEL_COLUMNS, model_rows(report))
    record.add_table("incidents", INCIDENT_COLUMNS, report["incidents"])
    record.write(out / "record.json")
    print(summary(report))
    print(f"[storm] report: {out / 'storm.json'}; its record: {out / 'record.json'}")
    if args.keep or (args.keep is None and full):
        kept = record.write(record.kept_path(f"storm-{args.protocol}"))
        print(f"[storm] record kept: {kept.relative_to(REPO_ROOT)} (make tables writes docs/server.md's storm table)")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
