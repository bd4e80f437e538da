"""The default model folder and the environment variables the server's processes read: the launcher sets them, the
models, the frontend and the kernels read them.
"""

import signal

# The model folder the repository prepares (`make model`) and serves when none is named, relative to the repository
# root (the Makefile's DEFAULT_MODEL: tests/unit/test_launcher.py holds them equal).
DEFAULT_MODEL = "models/smollm2-135m-instruct"

# ---- set by the launcher, read by the models --------------------------------------------------------------------
MODEL_ENV_VAR = "LLM_MODEL"  # the model folder; beats the config's `model` parameter
SHARED_CORES_ENV_VAR = "LLM_SHARED_CORES"  # the registry file of the engines that share the cores
STOP_BOARD_ENV_VAR = "LLM_STOP_BOARD"  # the directory where the frontend posts requests to stop (stop_board.py)
FAULTS_ENV_VAR = "LLM_TEST_FAULTS"  # "1": the test-only fault injection parameter is read
FAULTS_RELEASE_ENV_VAR = "LLM_TEST_RELEASE"  # the file whose creation lets a test-only held step go on
ADMIN_KEY_ENV_VAR = "TRITON_ADMIN_KEY"  # the key of Triton's model-control and shutdown endpoints
SERVER_HOME_ENV_VAR = "TRITONSERVER_HOME"  # a tritonserver layout to use instead of the one made in .triton/

# ---- `make serve` and the container (each beside its command-line flag) -----------------------------------------
MODEL_DIR_ENV_VAR = "MODEL"  # --model
STALL_TIMEOUT_ENV_VAR = "STALL_TIMEOUT"  # --stall-timeout
HANG_TIMEOUT_ENV_VAR = "HANG_TIMEOUT"  # --hang-timeout
OPENAI_PORT_ENV_VAR = "OPENAI_PORT"  # the OpenAI frontend's --port
API_KEY_ENV_VAR = "LLM_API_KEY"  # the OpenAI frontend's API key
SERVED_MODELS_ENV_VAR = "LLM_SERVED_MODELS"  # --models
DRAIN_DELAY_ENV_VAR = "DRAIN_DELAY"  # --drain-delay
MODEL_PARAMETERS_ENV_VAR = "LLM_MODEL_PARAMETERS"  # --parameter, space-separated KEY=VALUE

# ---- the engine's kernels and weights (switches for tests and benchmarks) ---------------------------------------
CPU_MARCH_ENV_VAR = "LLM_CPU_MARCH"  # -march of the C kernels (native)
CPU_KERNELS_ENV_VAR = "LLM_CPU_KERNELS"  # "0": no C kernels
WEIGHT_FILE_ENV_VAR = "LLM_WEIGHT_FILE"  # "0": no prepared-weights file

# ---- between the launcher and the OpenAI frontend ----------------------------------------------------------------
# The launcher's word to its frontend that the server is about to stop: /health/ready answers 503 from then on.
DRAINING_SIGNAL = signal.SIGUSR1
