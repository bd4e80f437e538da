"""What routers read from the frontend: ``/get_load`` (vLLM's and SGLang's ``power_of_two``), and ``/health/ready``
while the server drains."""

from __future__ import annotations

import asyncio
import http.server
import threading

import pytest
from fastapi.testclient import TestClient

from frontend.openai import app as app_module
from frontend.openai.app import Settings, create_app, start_draining
from frontend.openai.triton_health import TritonHealth

METRICS = """\
# HELP llm_num_requests_running Sequences in the running batch
llm_num_requests_running{model="llm_continuous"} 3
llm_num_requests_running{model="llm_dynamic"} 2
llm_num_requests_waiting{model="llm_continuous"} 4
llm_num_requests_waiting{model="llm_dynamic"} 0
nv_inference_pending_request_count{model="llm_dynamic",version="1"} 5
llm_kv_blocks_used{model="llm_continuous"} 99
"""


@pytest.fixture
def metrics_url():
    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = METRICS.encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()


def test_load_sums_the_engines_requests_and_tritons_queue(smollm2_dir, metrics_url):
    app = create_app(Settings("127.0.0.1:1", str(smollm2_dir), api_key="secret", triton_metrics_url=metrics_url))
    with TestClient(app) as client:
        response = client.get("/get_load")  # open like the health routes: the router sends no API key
    assert response.status_code == 200
    assert response.json() == {"load": 3 + 2 + 4 + 0 + 5}


def test_load_is_503_while_the_metrics_do_not_answer(smollm2_dir):
    app = create_app(Settings("127.0.0.1:1", str(smollm2_dir), triton_metrics_url="http://127.0.0.1:1/metrics"))
    with TestClient(app) as client:
        response = client.get("/get_load")
    assert response.status_code == 503
    assert "do not answer" in response.json()["error"]["message"]


class PresentTriton(TritonHealth):
    """The background probe as it reads while Triton answers: never away."""

    async def run(self, on_back) -> None:
        await asyncio.Event().wait()


def test_draining_makes_readiness_503_while_requests_are_still_served(smollm2_dir, metrics_url, monkeypatch):
    # NOTE: nothing listens at 127.0.0.1:1, and a probe that found that first (it raced the request on a loaded
    # machine) answered readiness with "Triton refuses connections" instead of the drain's reason.
    monkeypatch.setattr(app_module, "TritonHealth", PresentTriton)
    app = create_app(Settings("127.0.0.1:1", str(smollm2_dir), triton_metrics_url=metrics_url))
    with TestClient(app) as client:
        start_draining(app)
        ready = client.get("/health/ready")
        assert ready.status_code == 503 and "about to stop" in ready.json()["error"]["message"]
        assert client.get("/get_load").status_code == 200  # everything else goes on
