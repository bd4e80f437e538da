"""What the soak prints and keeps: a line per cell as it ends, the table and verdict at the end, the picture of RSS and
KV blocks over time, and its run record (``records/runs/soak-<cpu>.json``) with one row per cell (its rounds
together) and one per pattern, from which ``records.tables`` writes docs/server.md's soak tables."""

from __future__ import annotations

import os
from pathlib import Path

from backend.contract.names import KV_BLOCKS_USED, NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING, PENDING_REQUESTS
from records.record import Column, Record

OUTCOMES = ("completed", "cancelled", "errors", "lost")


def cell_line(cell: dict) -> str:
    after = cell["after"]
    answered, batch = cell["full_batch_after"]
    return (f"{cell['pattern']} x{cell['clients']} {cell['model']} (round {cell['round'] + 1}): {cell['requests']} "
            f"requests, {cell['completed']} completed, {cell['cancelled']} cancelled, {cell['errors']} errors, "
            f"{cell['lost']} lost; pending {after.get(PENDING_REQUESTS)}, KV {after.get(KV_BLOCKS_USED)}, "
            f"a full batch after: {answered}/{batch} answered "
            f"({cell['seconds']:.1f} s{', out of time' if cell['out_of_time'] else ''})")


def server_line(server: dict) -> str:
    """A server's life: how long it took to start, how its stop went."""
    where = f"{server['pattern']} x{server['clients']}"
    if server.get("start_error"):
        return f"{where}: did not start: {server['start_error'][:300]}"
    stop = server["stop"]
    line = f"{where}: ready in {server['start_s']:.1f} s; "
    if server.get("died") is not None:
        site = f" in {server['crash_site']}" if server.get("crash_site") else ""
        line += f"died during its cells (status {server['died']}{site}); "
    line += f"exit status {stop['exit_status']}"
    if stop["exited_after_s"] is not None:
        line += f" {stop['exited_after_s']} s after SIGTERM"
    if stop["forced_models"]:
        line += f"; the stop ended {', '.join(stop['forced_models'])} by force"
    if stop["frontend_exit"] != "not started":
        line += f"; the OpenAI frontend exited {stop['frontend_exit']}"
    return line


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
    errors: dict[str, int] = {}
    for cell in report["cells"]:
        for reason, count in cell["error_reasons"].items():
            errors[reason] = errors.get(reason, 0) + count
    lines = [f"soak: {report['requests']} requests in {report['duration_s']} s, {len(report['cells'])} cells on "
             f"{len(report['servers'])} servers (* = stopped by --duration-limit)", *table(report["cells"])]
    if errors:
        lines.append("  errors by reason: " + ", ".join(f"{k} {v}" for k, v in sorted(errors.items())))
    lines.append("  servers (one for each pattern and number of clients):")
    lines += [f"    {server_line(s)}" for s in report["servers"]]
    growth = [s["rss"]["growth"] for s in report["servers"] if s.get("rss", {}).get("growth") is not None]
    if growth:
        lines.append(f"  peak RSS of a server's process tree, last round against first: at most "
                     f"{100 * max(growth):+.2f} % (limit {100 * report['rss_growth_limit']:.0f} %)")
    lines += [f"  {'ok  ' if ok else 'FAIL'} {name}" for name, ok in report["checks"].items()]
    for server in report["servers"]:
        if server.get("died") is not None:
            lines.append(f"  {server['pattern']} x{server['clients']}: tritonserver's last lines:")
            lines += [f"    {line}" for line in server.get("log_tail", [])]
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
    fig, (ax_rss, ax_kv) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    # NOTE: the servers of a pattern run side by side: a series per number of clients, its servers one after another.
    for num_clients in sorted({s["clients"] for s in samples}):
        mine = [s for s in samples if s["clients"] == num_clients]
        ax_rss.plot([s["t"] for s in mine], [s["rss_bytes"] / 2**20 for s in mine], ".", markersize=1,
                    label=f"{num_clients} client{'s' * (num_clients > 1)}")
    busiest = [s for s in samples if s["clients"] == max((s["clients"] for s in samples), default=0)]
    for i, model in enumerate(report["models"]):
        for number, group in enumerate(sorted({s["group"] for s in busiest})):  # a line per server
            mine = [s for s in busiest if s["group"] == group]
            ax_kv.plot([s["t"] for s in mine],
                       [s.get("gauges", {}).get(model, {}).get(KV_BLOCKS_USED, float("nan")) for s in mine],
                       color=f"C{i}", label=model if number == 0 else None)
    ax_rss.set_ylabel("tritonserver tree RSS (MiB)")
    ax_rss.legend(loc="upper right", fontsize=7)
    for server in report["servers"]:  # a faint line where each server of the most clients starts
        if server.get("t_start") is not None and busiest and server["clients"] == busiest[0]["clients"]:
            for ax in (ax_rss, ax_kv):
                ax.axvline(server["t_start"], color="lightgrey", linewidth=0.8)
            ax_kv.annotate(server["pattern"], (server["t_start"], 1), xycoords=("data", "axes fraction"),
                           rotation=90, fontsize=6, va="top")
    ax_kv.set_ylabel("KV blocks in use (the most clients)")
    ax_kv.set_xlabel("seconds")
    ax_kv.legend(loc="upper right", fontsize=7)
    fig.suptitle(f"soak: {report['requests']} requests, {report['outcomes']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


# ---- the run record -------------------------------------------------------------------------------------------

CELL_COLUMNS = [
    Column("pattern"), Column("clients"), Column("model"), Column("requests"),
    *(Column(k) for k in OUTCOMES),
    Column("pending_after", "pending after", "{:g}"), Column("kv_after", "KV blocks after", "{:g}"),
    Column("full_batch_after", "full batch after"), Column("forced", "forced unload"),
    Column("exit_status", "exit status"), Column("load_s", "load s", "{:.0f}"),
    Column("after_s", "settling s", "{:.0f}"), Column("req_per_s", "req/s", "{:.1f}"),
]
PATTERN_COLUMNS = [
    Column("pattern"), Column("requests"), *(Column(k) for k in OUTCOMES),
    Column("cells_idle_after", "cells idle after"), Column("forced", "forced unload after"),
    Column("exit_status", "exit status"),
]
SERVER_COLUMNS = [
    Column("pattern"), Column("clients"), Column("start_s", "start s", "{:.1f}"), Column("stop_s", "stop s", "{:.1f}"),
    Column("exit_status", "exit status"), Column("forced", "ended by force"), Column("died", "died during its cells"),
    Column("rss_growth", "peak RSS growth", "{:+.2%}"),
]


def idle_after(cell: dict) -> bool:
    """Nothing pending in Triton, nothing in the engine, no KV block in use, and a full batch answered."""
    after, (answered, batch) = cell["after"], cell["full_batch_after"]
    return (all(after.get(name) == 0 for name in (PENDING_REQUESTS, NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING,
                                                  KV_BLOCKS_USED)) and answered == batch > 0)


def _stops(server: dict) -> int:
    return int(server.get("stop", {}).get("exit_status") is not None and server.get("died") is None)


def cell_rows(report: dict) -> list[dict]:
    """One row per cell (pattern, clients, model), its rounds together."""
    servers = {(s["pattern"], s["clients"]): s for s in report["servers"]}
    rows = []
    for (pattern, clients), server in servers.items():
        for model in report["models"]:
            runs = [c for c in report["cells"] if (c["pattern"], c["clients"], c["model"]) == (pattern, clients, model)]
            if not runs:
                continue
            forced = int(model in server.get("stop", {}).get("forced_models", ()))
            load_s = sum(c["seconds"] for c in runs)
            requests = sum(c["requests"] for c in runs)
            rows.append({
                "pattern": pattern, "clients": clients, "model": model, "requests": requests,
                **{k: sum(c[k] for c in runs) for k in OUTCOMES},
                "pending_after": max(c["after"].get(PENDING_REQUESTS, float("nan")) for c in runs),
                "kv_after": max(c["after"].get(KV_BLOCKS_USED, float("nan")) for c in runs),
                "full_batch_after": "{}/{}".format(*min((c["full_batch_after"] for c in runs), key=lambda f: f[0])),
                "forced": f"{forced}/{_stops(server)}",
                "exit_status": server.get("stop", {}).get("exit_status"),
                "load_s": round(load_s, 1),
                "after_s": round(sum(c["after_s"] for c in runs), 1),
                "req_per_s": round(requests / load_s, 2) if load_s else None,
            })
    return rows


def pattern_rows(report: dict, rows: list[dict]) -> list[dict]:
    out = []
    for pattern in report["patterns"]:
        mine = [r for r in rows if r["pattern"] == pattern]
        cells = [c for c in report["cells"] if c["pattern"] == pattern]
        forced = [f"{r['model']} x{r['clients']}" for r in mine if not r["forced"].startswith("0/")]
        statuses = sorted({str(s["stop"]["exit_status"]) for s in report["servers"]
                           if s["pattern"] == pattern and "stop" in s})
        out.append({
            "pattern": pattern, "requests": sum(r["requests"] for r in mine),
            **{k: sum(r[k] for r in mine) for k in OUTCOMES},
            "cells_idle_after": f"{sum(map(idle_after, cells))} of {len(cells)}",
            "forced": ", ".join(forced) or "none", "exit_status": ", ".join(statuses),
        })
    return out


def server_rows(report: dict) -> list[dict]:
    return [{
        "pattern": s["pattern"], "clients": s["clients"], "start_s": s.get("start_s"), "stop_s": s.get("stop_s"),
        "exit_status": s.get("stop", {}).get("exit_status"),
        "forced": ", ".join(s.get("stop", {}).get("forced_models", ())) or "none",
        "died": "no" if s.get("died") is None else f"status {s['died']}" + (
            f" in {s['crash_site']}" if s.get("crash_site") else ""),
        "rss_growth": s.get("rss", {}).get("growth"),
    } for s in report["servers"]]


MACHINE_COLUMNS = [Column("cpus", "CPUs"), Column("load_mean", "load average (mean)", "{:.1f}"),
                   Column("load_max", "load average (max)", "{:.1f}")]


def load_average(samples: list[float]) -> dict:
    """The machine's 1-minute load average over a run (sampled every second): how busy it was besides the run, which
    a reader of its rates needs (the soak and the storm on 2 CPUs share them with whatever else runs)."""
    return {"cpus": os.cpu_count(), "load_mean": round(sum(samples) / len(samples), 2) if samples else None,
            "load_max": round(max(samples), 2) if samples else None}


def make_record(record: Record, report: dict) -> Record:
    rows = cell_rows(report)
    record.add_table("patterns", PATTERN_COLUMNS, pattern_rows(report, rows),
                     "every cell of a pattern (both numbers of clients, every model, every round)")
    record.add_table("cells", CELL_COLUMNS, rows, "a cell's rounds together; forced unload: the stops that ended "
                     "this model by force / the stops of its server")
    record.add_table("servers", SERVER_COLUMNS, server_rows(report))
    record.add_table("machine", MACHINE_COLUMNS, [report["load_average"]])
    record.notes.append(f"{report['requests']} requests in {report['duration_s']} s; checks: "
                        + ", ".join(f"{name} {'ok' if ok else 'FAILED'}" for name, ok in report["checks"].items()))
    return record
