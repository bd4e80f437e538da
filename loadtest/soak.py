"""Soak: clients that misbehave, on every model, through a real server; every accepted request must end with exactly
one final response (its answer or an error that says why), and the server must let go of everything afterwards.

    python -m loadtest.soak [--patterns P,...] [--models M,...] [--requests 500] [--clients 1,8] [--rounds 2]
                            [--duration-limit 1800] [--model DIR] [--model-repository DIR] [--out DIR]

Starts its own tritonserver (the launcher's way, on free 127.0.0.1 ports; the OpenAI frontend beside it when a
pattern needs it). Then, for each pattern (``loadtest/soak_patterns.py``), each number of clients and each model in
turn (a *cell*), that many client threads send ``--requests`` requests in all to that model, and none after
``--duration-limit`` seconds. Every request is accounted for as completed, cancelled, an error that says why, or
lost. After each cell the model must settle within ``--settle-timeout``: nothing pending in Triton
(``nv_inference_pending_request_count``), nothing running or waiting in the engine, no KV block in use; and it must
answer a full batch (a request for each of its ``max_num_seqs`` seats, at once), which it cannot if it kept a seat
for a request that is gone. At the end the frontend and then tritonserver get SIGTERM; tritonserver must exit 0
within its exit timeout.

All of it runs ``--rounds`` times. Meanwhile it samples, every second, the resident memory of the tritonserver
process tree (server + Python-backend stubs, psutil) and the models' gauges. The same work done again must not need
more memory: from two rounds on, the last round's peak RSS is compared with the first's.

Writes ``soak.json`` (every cell, the samples, the shutdown, the verdict) and ``soak.png`` (RSS and KV over time)
under ``--out`` (default ``reports/soak-<time>/``), prints a table, and exits 1 unless every target holds: no
request lost, every cell settled and answered a full batch after it, the peak RSS grows by less than
``--rss-growth-limit`` (5 %) from the first round to the last, the server stayed up and exited 0 within its grace on
SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import requests

from backend.contract.names import (
    KV_BLOCKS_USED,
    MODELS,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    PENDING_REQUESTS,
)
from backend.contract.settings import DEFAULT_MODEL
from backend.triton.launcher import crash
from backend.triton.launcher.launch_options import free_ports
from backend.triton.launcher.processes import process_names, tree_rss
from backend.triton.launcher.server import start_on_free_ports
from backend.triton.launcher.shutdown import exit_status
from frontend.openai.process import FrontendProcess
from loadtest.metrics import parse_prometheus, scrape, select
from loadtest.soak_patterns import PATTERNS, Accounts, Budget, Client, Target, full_batch, play

REPO_ROOT = Path(__file__).resolve().parents[1]
# What a model must be back to after each cell: Triton's queue, the engine's requests, the KV cache.
GAUGES = (PENDING_REQUESTS, NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING, KV_BLOCKS_USED)
OPENAI_PATTERNS = ("openai_stream_disconnect",)


def read_gauges(metrics_url: str, models) -> dict[str, dict[str, float]]:
    """``{model: {gauge: value}}`` from one scrape of the metrics port (a gauge the model does not export: NaN)."""
    series = parse_prometheus(scrape(metrics_url, timeout=10))
    out = {}
    for model in models:
        values = select(series, model, buckets=False)
        out[model] = {name: values.get(name, float("nan")) for name in GAUGES}
    return out


class Soak:
    def __init__(self, server, target: Target, args) -> None:
        self.server = server
        self.target = target
        self.args = args
        self.cells: list[dict] = []
        self.samples: list[dict] = []
        self.stop = threading.Event()
        self.round_ends: list[float] = []  # seconds since t0
        self.t0 = time.monotonic()

    # -- one cell: a pattern, a number of clients, a model

    def run_cell(self, round_index: int, pattern: str, num_clients: int, model: str) -> dict:
        args = self.args
        accounts, budget = Accounts(), Budget(args.requests, args.duration_limit)
        seed = f"{args.seed}:{round_index}:{pattern}:{num_clients}:{model}"
        clients = [Client(i, self.target, model, random.Random(f"{seed}:{i}"), budget, accounts)
                   for i in range(num_clients)]
        threads = [threading.Thread(target=play, args=(PATTERNS[pattern], c), daemon=True) for c in clients]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        # A client finishes the request (a sequence: the requests) it took before the deadline; each waits at most
        # the request timeout.
        join_by = started + args.duration_limit + (args.sequence_length + 1) * args.request_timeout + 30
        for thread in threads:
            thread.join(max(0.0, join_by - time.monotonic()))
        still_running = [c for c, t in zip(clients, threads) if t.is_alive()]
        for client in still_running:  # NOTE: its thread may still account them later; this cell's count is final
            client.lose_open("the client was still waiting when the cell ended")
        seconds = time.monotonic() - started
        settled = self.settle(model)
        answered, batch = full_batch(self.target, model) if self.server.is_running else (0, 0)
        if answered < batch:  # what it left pending, if anything, is this cell's
            settled = self.settle(model)
        return {
            "round": round_index,
            "pattern": pattern,
            "clients": num_clients,
            "model": model,
            "t_start": round(started - self.t0, 2),
            "seconds": round(seconds, 2),
            "requests": accounts.num_requests,
            "out_of_time": budget.num_left > 0,
            "completed": accounts.counts["completed"],
            "cancelled": accounts.counts["cancelled"],
            "errors": accounts.counts["error"],
            "lost": accounts.counts["lost"],
            "error_reasons": dict(accounts.errors),
            "lost_reasons": accounts.lost,
            "client_failures": accounts.failures,
            "clients_still_running": len(still_running),
            "after": settled["gauges"],
            "settled_after_s": settled["seconds"],
            "full_batch_after": [answered, batch],
        }

    def settle(self, model: str) -> dict:
        """Poll the model's gauges until all are 0 or ``--settle-timeout`` passes; the last reading."""
        started = time.monotonic()
        while True:
            try:
                gauges = read_gauges(self.server.metrics_url, [model])[model]
            except (OSError, requests.RequestException) as exc:
                gauges = {"metrics_error": str(exc)}
            idle = all(gauges.get(name) == 0 for name in GAUGES)
            if idle or time.monotonic() - started > self.args.settle_timeout or not self.server.is_running:
                return {"gauges": gauges, "seconds": round(time.monotonic() - started, 2)}
            time.sleep(0.25)

    # -- sampling

    def sample(self) -> dict:
        rss = tree_rss(self.server.pid)
        row = {"t": round(time.monotonic() - self.t0, 2), "rss_bytes": sum(rss.values()), "rss_by_pid": rss}
        try:
            row["gauges"] = read_gauges(self.server.metrics_url, self.args.models)
        except (OSError, requests.RequestException) as exc:
            row["metrics_error"] = str(exc)
        return row

    def sampler(self) -> None:
        while not self.stop.is_set():
            self.samples.append(self.sample())
            self.stop.wait(self.args.sample_interval)

    def run(self) -> float:
        """Every cell of every round in turn; returns the seconds it took. Stops early if the server exits."""
        sampler = threading.Thread(target=self.sampler, daemon=True)
        sampler.start()
        try:
            for round_index in range(self.args.rounds):
                for pattern in self.args.patterns:
                    for num_clients in self.args.clients:
                        for model in self.args.models:
                            if not self.server.is_running:
                                print(f"[soak] tritonserver exited ({self.server.returncode}); stopping", flush=True)
                                self.round_ends.append(time.monotonic() - self.t0)  # the round it stopped in
                                return time.monotonic() - self.t0
                            cell = self.run_cell(round_index, pattern, num_clients, model)
                            self.cells.append(cell)
                            print("[soak] " + cell_line(cell), flush=True)
                self.round_ends.append(time.monotonic() - self.t0)
        finally:
            self.stop.set()
            sampler.join(10)
        return time.monotonic() - self.t0

    def rss_report(self) -> dict:
        """The tree's peak RSS in each round, and its growth from the first round to the last (from two rounds on)."""
        # NOTE: 0 bytes means the process tree was gone when sampled; such a sample says nothing.
        starts = [0.0, *self.round_ends[:-1]]
        peaks = [max((s["rss_bytes"] for s in self.samples if start <= s["t"] < end), default=0)
                 for start, end in zip(starts, self.round_ends)]
        growth = peaks[-1] / peaks[0] - 1 if len(peaks) > 1 and peaks[0] and peaks[-1] else None
        by_process = {}
        for pid, name in process_names(self.server.pid).items():
            series = [b for s in self.samples if (b := s["rss_by_pid"].get(pid))]
            if series:
                by_process[f"{name} ({pid})"] = {"first_mb": mib(series[0]), "last_mb": mib(series[-1]),
                                                  "max_mb": mib(max(series))}
        return {
            "peak_by_round_mb": [mib(b) for b in peaks],
            "growth": None if growth is None else round(growth, 4),
            "limit": self.args.rss_growth_limit,
            "by_process": by_process,
        }


def mib(num_bytes: float) -> float:
    return round(num_bytes / 2**20, 1)


def stop_server(server, grace: float) -> dict:
    """SIGTERM through the launcher's graceful stop; tritonserver's exit status and how long after the signal it
    exited (its stubs are waited for afterwards)."""
    started = time.monotonic()
    server.begin_stop()
    while server.is_running and time.monotonic() - started < grace + 30:
        time.sleep(0.05)
    exited_after = time.monotonic() - started
    code = server.stop(timeout=1)  # collects it; SIGKILLs the group if it is still running
    # As `make serve` reports it: 0 also when the stop had to end a model Triton 2.51 could not unload with nothing
    # open (the `forced` line says so); 128 + N for a signal.
    stopped = server.stop_result
    return {"exit_status": exit_status(code, stopped), "exited_after_s": round(exited_after, 2),
            "grace_s": grace, "forced": stopped.forced if stopped else None}


def verdict(report: dict, args) -> dict:
    cells = report["cells"]
    rss, shutdown = report["rss"], report["shutdown"]
    checks = {
        "server_stayed_up": report["server_exit_during_soak"] is None,
        "every_cell_ran": len(cells) == args.rounds * len(args.patterns) * len(args.clients) * len(args.models)
        and all(c["requests"] > 0 for c in cells),
        "no_request_lost": all(c["lost"] == 0 and not c["client_failures"] and not c["clients_still_running"]
                               for c in cells),
        "nothing_pending_in_triton_after_each_cell": all(c["after"].get(PENDING_REQUESTS) == 0 for c in cells),
        "engine_idle_after_each_cell": all(c["after"].get(NUM_REQUESTS_RUNNING) == 0
                                           and c["after"].get(NUM_REQUESTS_WAITING) == 0 for c in cells),
        "kv_blocks_back_to_zero_after_each_cell": all(c["after"].get(KV_BLOCKS_USED) == 0 for c in cells),
        "full_batch_answered_after_each_cell": all(c["full_batch_after"][0] == c["full_batch_after"][1] > 0
                                                   for c in cells),
        "sigterm_exit_0_within_grace": shutdown["exit_status"] == 0
        and shutdown["exited_after_s"] <= shutdown["grace_s"],
    }
    if args.rounds > 1:
        checks["peak_rss_growth_between_rounds_below_limit"] = (
            rss["growth"] is not None and rss["growth"] < args.rss_growth_limit
        )
    if report["frontend_exit"] != "not started":
        checks["frontend_exit_0"] = report["frontend_exit"] == 0
    return checks


# ---- the report ------------------------------------------------------------------------------------------------


def cell_line(cell: dict) -> str:
    after = cell["after"]
    answered, batch = cell["full_batch_after"]
    return (f"{cell['pattern']} x{cell['clients']} {cell['model']}: {cell['requests']} requests, "
            f"{cell['completed']} completed, {cell['cancelled']} cancelled, {cell['errors']} errors, "
            f"{cell['lost']} lost; pending {after.get(PENDING_REQUESTS)}, KV {after.get(KV_BLOCKS_USED)}, "
            f"a full batch after: {answered}/{batch} answered "
            f"({cell['seconds']:.1f} s{', out of time' if cell['out_of_time'] else ''})")


def table(cells: list[dict]) -> list[str]:
    header = ("round", "pattern", "clients", "model", "requests", "completed", "cancelled", "errors", "lost",
              "pending after", "KV after", "full batch after", "seconds", "settled in s")
    rows = [header] + [
        (str(c["round"] + 1), c["pattern"], str(c["clients"]), c["model"],
         str(c["requests"]) + ("*" if c["out_of_time"] else ""),
         str(c["completed"]), str(c["cancelled"]), str(c["errors"]), str(c["lost"]),
         f"{c['after'].get(PENDING_REQUESTS, float('nan')):g}", f"{c['after'].get(KV_BLOCKS_USED, float('nan')):g}",
         "{}/{}".format(*c["full_batch_after"]),
         f"{c['seconds']:.1f}", f"{c['settled_after_s']:.1f}")
        for c in cells
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return ["  ".join(v.ljust(w) if i < 4 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths)))
            for row in rows]


def summary(report: dict) -> str:
    rss, shutdown = report["rss"], report["shutdown"]
    growth = "one round: not compared" if rss["growth"] is None else f"{100 * rss['growth']:+.2f} %"
    errors: dict[str, int] = {}
    for cell in report["cells"]:
        for reason, count in cell["error_reasons"].items():
            errors[reason] = errors.get(reason, 0) + count
    lines = [f"soak: {report['requests']} requests in {report['duration_s']} s, {len(report['cells'])} cells "
             "(* = stopped by --duration-limit)", *table(report["cells"])]
    if errors:
        lines.append("  errors by reason: " + ", ".join(f"{k} {v}" for k, v in sorted(errors.items())))
    lines += [
        f"  peak RSS of the tritonserver tree by round: {rss['peak_by_round_mb']} MiB ({growth}; "
        f"limit {100 * rss['limit']:.0f} %)",
        f"  SIGTERM: tritonserver exited with status {shutdown['exit_status']} after {shutdown['exited_after_s']} s "
        f"(grace {shutdown['grace_s']:g} s); the OpenAI frontend: {report['frontend_exit']}",
    ]
    if shutdown.get("forced"):
        lines.append(f"  the stop {shutdown['forced']}")
    lines += [f"  {'ok  ' if ok else 'FAIL'} {name}" for name, ok in report["checks"].items()]
    if report.get("server_exit_during_soak") is not None:
        lines.append(f"  tritonserver exited with status {report['server_exit_during_soak']} during the soak; "
                     "its last lines:")
        lines += [f"    {line}" for line in report.get("server_log_tail", [])]
        if report.get("server_crash_site"):
            lines.append(f"  it crashed in {report['server_crash_site']}")
    for cell in report["cells"]:
        where = f"round {cell['round'] + 1} {cell['pattern']} x{cell['clients']} {cell['model']}"
        lines += [f"  lost ({where}): {reason}" for reason in cell["lost_reasons"][:5]]
        lines += [f"  client failed ({where}): {reason}" for reason in cell["client_failures"][:3]]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    samples = report["samples"]
    t = [s["t"] for s in samples]
    fig, (ax_rss, ax_kv) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    ax_rss.plot(t, [s["rss_bytes"] / 2**20 for s in samples])
    ax_rss.set_ylabel("tritonserver tree RSS (MiB)")
    for model in report["models"]:
        ax_kv.plot(t, [s.get("gauges", {}).get(model, {}).get(KV_BLOCKS_USED, float("nan")) for s in samples],
                   label=model)
    for cell in report["cells"]:  # a faint line where each pattern starts
        if cell["round"] == 0 and cell["clients"] == report["clients"][0] and cell["model"] == report["models"][0]:
            for ax in (ax_rss, ax_kv):
                ax.axvline(cell["t_start"], color="lightgrey", linewidth=0.8)
            ax_kv.annotate(cell["pattern"], (cell["t_start"], 1), xycoords=("data", "axes fraction"), rotation=90,
                           fontsize=6, va="top")
    ax_kv.set_ylabel("KV blocks in use")
    ax_kv.set_xlabel("seconds")
    ax_kv.legend(loc="upper right", fontsize=7)
    fig.suptitle(f"soak: {report['requests']} requests, {report['outcomes']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def crash_lines(log: Path, count: int = 12) -> list[str]:
    """The server log's last lines, from its last "Signal (N) received." on if it has one (the crash and its stack)."""
    return crash.crash_lines(log.read_text(errors="replace").splitlines() if log.exists() else [], count)


# ---- the command line -----------------------------------------------------------------------------------------


def names_list(known: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        chosen = list(known) if text == "all" else [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in chosen if name not in known]
        if unknown or not chosen:
            raise argparse.ArgumentTypeError(f"{', '.join(unknown) or text!r}: choose from {', '.join(known)}")
        return chosen

    return parse


def client_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of positive numbers of clients")
    return counts


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--patterns", type=names_list(tuple(PATTERNS)), default=list(PATTERNS),
                        help=f"comma-separated, or all (default): {', '.join(PATTERNS)}")
    parser.add_argument("--models", type=names_list(MODELS), default=list(MODELS),
                        help=f"comma-separated, or all (default): {', '.join(MODELS)}")
    parser.add_argument("--requests", type=int, default=500,
                        help="requests per cell: pattern, model, number of clients, round (default: %(default)s)")
    parser.add_argument("--clients", type=client_counts, default=[1, 8],
                        help="numbers of clients at once, each a cell of its own (default: 1,8)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="times the whole soak runs; from 2 on, RSS growth is checked (default: %(default)s)")
    parser.add_argument("--duration-limit", type=float, default=1800.0,
                        help="seconds after which a cell sends no new request (default: %(default)s)")
    parser.add_argument("--model", default=None, help="HF model folder (default: the repository's own setting)")
    parser.add_argument("--model-repository", default=str(REPO_ROOT / "model_repository"))
    parser.add_argument("--max-tokens", type=int, default=32, help="largest max_tokens of a request run to its end")
    parser.add_argument("--long-tokens", type=int, default=200,
                        help="max_tokens of a request that is cancelled or dropped (default: %(default)s)")
    parser.add_argument("--sequence-length", type=int, default=20,
                        help="the longest multi-request sequence (perf_analyzer's default: %(default)s)")
    parser.add_argument("--request-timeout", type=float, default=120.0,
                        help="seconds a request may take to its final response (default: %(default)s)")
    parser.add_argument("--settle-timeout", type=float, default=30.0,
                        help="seconds a model may take to be idle after a cell (default: %(default)s)")
    parser.add_argument("--exit-timeout", type=float, default=10.0,
                        help="tritonserver's --exit-timeout-secs, the grace SIGTERM must end within")
    parser.add_argument("--sample-interval", type=float, default=1.0)
    parser.add_argument("--rss-growth-limit", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="report folder (default: reports/soak-<time>)")
    parser.add_argument("--server-arg", action="append", default=[], help="extra tritonserver argument (repeatable)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out) if args.out else REPO_ROOT / "reports" / time.strftime("soak-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    wants_frontend = any(p in OPENAI_PATTERNS for p in args.patterns)
    frontend = None
    server = start_on_free_ports(
        args.model_repository,
        model=args.model,
        log_path=out / "tritonserver.log",
        extra_args=["--exit-timeout-secs", f"{args.exit_timeout:g}", *args.server_arg],
        ready_timeout=600,
    )
    with server:
        if wants_frontend:
            frontend = FrontendProcess(server.grpc_url, free_ports(1)[0], args.model or REPO_ROOT / DEFAULT_MODEL,
                                       log_path=out / "frontend.log").__enter__()
        target = Target(server.grpc_url, server.http_url, frontend.url if frontend else None, args.request_timeout,
                        args.max_tokens, args.long_tokens, args.sequence_length)
        print(f"[soak] server ready (pid {server.pid}): {', '.join(args.patterns)} on {', '.join(args.models)}, "
              f"{args.requests} requests per cell, clients {args.clients}", flush=True)
        soak = Soak(server, target, args)
        try:
            load_seconds = soak.run()
            rss = soak.rss_report()
        finally:
            frontend_exit = frontend.stop() if frontend else "not started"
        server_exit = server.returncode
        shutdown = stop_server(server, args.exit_timeout) if server_exit is None else {
            "exit_status": server_exit, "exited_after_s": None, "grace_s": args.exit_timeout}
    cells = soak.cells
    outcomes = {k: sum(c[k] for c in cells) for k in ("completed", "cancelled", "errors", "lost")}
    report = {
        "patterns": args.patterns,
        "models": args.models,
        "clients": args.clients,
        "rounds": args.rounds,
        "requests_per_cell": args.requests,
        "duration_s": round(load_seconds, 1),
        "requests": sum(c["requests"] for c in cells),
        "outcomes": outcomes,
        "server_exit_during_soak": server_exit,
        "frontend_exit": frontend_exit,
        "shutdown": shutdown,
        "rss": rss,
        "cells": cells,
    }
    if server_exit is not None:
        report["server_log_tail"] = crash_lines(out / "tritonserver.log")
        report["server_crash_site"] = crash.crash_site(report["server_log_tail"])
    report["checks"] = verdict(report, args)
    report["ok"] = all(report["checks"].values())
    report["samples"] = soak.samples
    (out / "soak.json").write_text(json.dumps(report, indent=1) + "\n")
    plotted = plot(report, out / "soak.png")
    print(summary(report))
    print(f"[soak] report: {out / 'soak.json'}" + (f", {out / 'soak.png'}" if plotted else ""))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
