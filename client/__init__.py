"""Client library and CLI (``python -m client``) for the LLM models served on Triton; see client/core.py."""

from client.core import (
    DEFAULT_GRPC_URL,
    DEFAULT_HTTP_URL,
    ClientError,
    Generation,
    GenerationError,
    LLMClient,
    ModelNotServed,
    ServerUnavailable,
)
from client.schema import Chunk, GenerationRequest, GenerationResult, ModelInfo, build_inputs, describe_batching

__all__ = [
    "DEFAULT_GRPC_URL",
    "DEFAULT_HTTP_URL",
    "Chunk",
    "ClientError",
    "Generation",
    "GenerationError",
    "GenerationRequest",
    "GenerationResult",
    "LLMClient",
    "ModelInfo",
    "ModelNotServed",
    "ServerUnavailable",
    "build_inputs",
    "describe_batching",
]
