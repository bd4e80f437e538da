"""The formats a projection's weights are held in: the one list of their names, which every layer reads.

Plain Python (no torch): the engine's configuration, the tools and the load tests name formats by it too. What each
quantized format's bytes are is in ``quantized_linear``; which of them a user may ask for is the engine's
(``backend.engine.config.QUANTIZATIONS``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence


class WeightFormat(str, enum.Enum):
    """A weight format, by the name users type (``quantization=q4_1``, ``--formats bf16,int8``).

    A ``str`` enum, so a format is its name wherever it is written out (JSON, a config.pbtxt, a file's index) and
    reads back from it with ``WeightFormat(name)``.
    """

    BF16 = "bf16"  # not quantized: the checkpoint's weights in bf16
    Q4_1 = "q4_1"  # GGUF's 4-bit blocks
    Q8_0 = "q8_0"  # GGUF's 8-bit blocks (the Q4_1 file's token embedding, so its tied LM head)
    INT8 = "int8"  # int8 per output channel

    def __str__(self) -> str:  # the name, on Python 3.10 as on 3.11+ (whose default would be "WeightFormat.Q4_1")
        return self.value

    @property
    def quantized(self) -> bool:
        return self is not WeightFormat.BF16

    @property
    def c_code(self) -> int:
        """The C kernels' number for it (``linear_quant.c``'s ``WEIGHT_*``, ``decode_stack.c``'s ``wformat``)."""
        return _C_CODES[self]

    @classmethod
    def parse(cls, text: object, choices: Sequence[WeightFormat], setting: str, also: str = "") -> WeightFormat:
        """``text`` as a user gives it (a name in any case, spaces around) as one of ``choices``; else a
        ``ValueError`` that names ``setting`` and lists them (then ``also``, e.g. "or none")."""
        fmt = cls._value2member_map_.get(str(text).strip().lower())
        if fmt not in choices:
            names = ", ".join(choices) + (f" {also}" if also else "")
            raise ValueError(f"{setting} must be one of {names}; got {text!r}")
        return fmt


_C_CODES = {WeightFormat.BF16: 0, WeightFormat.Q4_1: 1, WeightFormat.INT8: 2, WeightFormat.Q8_0: 3}
