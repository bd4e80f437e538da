"""The live view and the report say when more than one model was under load at once (their engines then share the
cores: ``backend/engine/shared_cores.py``), from the metrics port's step counts; no server needed."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from loadtest import live, report
from loadtest.metrics import models_under_load, parse_prometheus, steps_by_model
from tests.unit.test_live import wait_for_data


def metrics_text(steps: dict[str, int]) -> str:
    lines = []
    for model, count in steps.items():
        lines += [f'llm_batch_size_count{{model="{model}",version="1"}} {count}',
                  f'llm_batch_size_sum{{model="{model}",version="1"}} {4 * count}',
                  f'llm_kv_blocks_total{{model="{model}",version="1"}} 64']
    return "\n".join(lines) + "\n"


def test_models_under_load_are_those_that_stepped_between_two_readings():
    first = steps_by_model(parse_prometheus(
        'llm_batch_size_count{model="a",instance="a_0"} 3\nllm_batch_size_count{model="a",instance="a_1"} 4\n'
        'llm_batch_size_count{model="b"} 10\nllm_batch_size_count{model="c"} 5\n'))
    assert first == {"a": 7, "b": 10, "c": 5}  # instances summed
    assert models_under_load(first, {"a": 8, "b": 10, "c": 9}) == ["a", "c"]
    assert models_under_load(first, {**first, "d": 2}) == []  # a model first seen now: no interval to judge


def test_the_live_view_says_which_models_were_under_load_each_second(monkeypatch):
    readings = iter([{"llm_dynamic": 0, "llm_continuous": 0}, {"llm_dynamic": 5, "llm_continuous": 0},
                     {"llm_dynamic": 9, "llm_continuous": 30}])
    monkeypatch.setattr(live, "scrape", lambda url, timeout: metrics_text(next(readings)))
    view = live.LiveView(live.LatencyBook(2000, 100), "http://127.0.0.1:1/metrics")
    for now in (100.0, 101.0, 102.0):
        view.tick(now)
    data = view.data()
    assert data["under_load"] == [[], ["llm_dynamic"], ["llm_continuous", "llm_dynamic"]]


def run(model: str, steps: list[dict[str, int]], window=(10.0, 20.0)) -> dict:
    samples = [{"t": t, "values": {}, "steps": s} for t, s in zip((9.0, 11.0, 19.0), steps)]
    return {"model": model, "load": "8 users", "window": window, "metrics": samples}


def test_the_report_says_whether_models_took_turns_or_shared_the_cores():
    dynamic_alone = run("llm_dynamic", [{"llm_dynamic": 0, "llm_continuous": 0},
                                        {"llm_dynamic": 10, "llm_continuous": 0},
                                        {"llm_dynamic": 90, "llm_continuous": 0}])
    continuous_alone = run("llm_continuous", [{"llm_dynamic": 90, "llm_continuous": 0},
                                              {"llm_dynamic": 90, "llm_continuous": 8},
                                              {"llm_dynamic": 90, "llm_continuous": 80}])
    assert report._shared_text([dynamic_alone, continuous_alone]).startswith("One model was under load at a time")
    together = run("llm_continuous", [{"llm_dynamic": 0, "llm_continuous": 0}, {"llm_dynamic": 10, "llm_continuous": 8},
                                      {"llm_dynamic": 50, "llm_continuous": 80}])
    text = report._shared_text([together])
    assert "More than one model was under load at once" in text
    assert "llm_continuous at 8 users (beside llm_dynamic)" in text
    older = {**together, "metrics": [{"t": 11.0, "values": {}}]}  # results from before the step counts: nothing said
    assert report._shared_text([older]) == ""


def test_the_live_page_says_two_models_are_under_load_at_once(monkeypatch, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no Chromium (make chromium)")
    steps = {"llm_dynamic": 0, "llm_continuous": 0}

    def scrape(url, timeout):  # both models step every second
        for model in steps:
            steps[model] += 10
        return metrics_text(steps)

    monkeypatch.setattr(live, "scrape", scrape)
    view = live.LiveView(live.LatencyBook(2000, 100), "http://127.0.0.1:1/metrics", interval_s=0.2)
    with live.serve(view) as page:
        wait_for_data(page.url, lambda d: any(d["under_load"]))  # a second read has seen both step
        done = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                               f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=4000",
                               "--dump-dom", page.url], capture_output=True, text=True, timeout=120)
    assert 'data-sharing="now"' in done.stdout
    assert "2 models under load at once now (llm_continuous, llm_dynamic)" in done.stdout
