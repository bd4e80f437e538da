"""Rows of a held q4_1 weight read back as GGUF's (``quantized_linear.gguf_rows``): only the groups the rows are in
are ungrouped, and the answer is the whole weight's, for rows in whole groups, in the tail, repeated or out of order."""

from __future__ import annotations

import pytest
import torch

from backend.kernels.quantized_linear import gguf_rows, group_rows, ungroup_rows
from backend.kernels.weight_format import WeightFormat
from tests.unit.test_q4_1_groups import gguf_rows as random_gguf_rows

Q4_1, Q8_0 = WeightFormat.Q4_1, WeightFormat.Q8_0


@pytest.mark.parametrize("n", [8, 16, 40, 96])
def test_rows_read_back_as_the_whole_weight_ungrouped(n):
    held = group_rows(Q4_1, random_gguf_rows(n, 64, seed=n))
    ids = torch.tensor([n - 1, 0, n // 2, n - 1, min(17, n - 1), 3])
    assert torch.equal(gguf_rows(Q4_1, held, ids), ungroup_rows(Q4_1, held)[ids])


def test_other_formats_are_indexed_as_they_are():
    weight = torch.randint(0, 256, (40, 68), dtype=torch.uint8)
    ids = torch.tensor([39, 2, 2])
    assert torch.equal(gguf_rows(Q8_0, weight, ids), weight[ids])
