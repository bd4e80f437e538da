"""What every kernel wrapper needs: interpreter detection, the dot-product mode, small shape helpers."""

import torch
import triton
import triton.language as tl


def is_interpreted(kernel) -> bool:
    """True when ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (it then runs on CPU tensors, in numpy)."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_device(kernel, *tensors: torch.Tensor) -> None:
    """Refuse, with a message a user can act on, tensors the kernel cannot read."""
    on_cpu = any(t.device.type == "cpu" for t in tensors)
    if on_cpu and not is_interpreted(kernel):
        raise ValueError(
            "OpenAI Triton kernels need CUDA tensors; to run them on CPU tensors (tests), set TRITON_INTERPRET=1 "
            "before backend.kernels is first imported"
        )


def dot_modes(kernel, dtype: torch.dtype) -> dict[str, bool]:
    """Constexpr flags that choose how ``tl.dot`` runs.

    IEEE_FP32: fp32 inputs use exact fp32 products, not TF32 (the fp32 engine must match HF's greedy tokens).
    UPCAST_DOT: the interpreter in triton 3.9 multiplies bf16/fp16 dot operands as their raw uint16 storage, so under
    it the operands are widened to fp32 first (after the same rounding to the cache dtype the GPU path does).
    """
    return {"IEEE_FP32": dtype == torch.float32, "UPCAST_DOT": is_interpreted(kernel) and dtype != torch.float32}


def pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, triton.next_power_of_2(n))


@triton.jit
def mma(a, b, IEEE_FP32: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """``a @ b`` accumulated in fp32, honouring the flags of :func:`dot_modes`."""
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE_FP32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)
