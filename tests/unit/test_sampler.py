"""The sampler on crafted logits: seeds make rows reproducible whatever else is in the batch; filters do what they
say."""

from __future__ import annotations

import collections

import pytest
import torch

from backend.engine.sampler import Sampler, logprob_rows, sample_rows
from backend.engine.sampling_params import SamplingParams
from backend.kernels import cpu_kernels

VOCAB = 1000
STEPS = 24


def random_logits(rows: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    # Flat-ish logits (std 2): many tokens are plausible, so sampling actually varies.
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2.0


def test_seeded_request_same_tokens_alone_and_in_a_batch(sampling_path):
    target = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=1234)
    others = [
        SamplingParams(temperature=1.0),  # unseeded: draws from the shared generator
        SamplingParams(temperature=1.3, seed=7),
        SamplingParams(temperature=0.0),  # greedy
        SamplingParams(temperature=0.7, top_p=0.5),  # unseeded with a filter
    ]
    alone, batched = Sampler(seed=0), Sampler(seed=99)
    tokens_alone, tokens_batched = [], []
    for step in range(STEPS):
        logits = random_logits(5, seed=step)  # row 2 is the target's in the batch
        tokens_alone += alone(logits[2:3], ["x"], [target])
        ids = ["u0", "s1", "x", "g3", "u4"]
        params = [others[0], others[1], target, others[2], others[3]]
        tokens_batched.append(batched(logits, ids, params)[2])
    assert tokens_alone == tokens_batched
    assert len(set(tokens_alone)) > 1  # it sampled, not argmax every time


def test_same_seed_different_request_ids_same_tokens():
    params = SamplingParams(temperature=1.0, seed=5)
    sampler = Sampler()
    a = [sampler(random_logits(1, seed=s), ["a"], [params])[0] for s in range(STEPS)]
    b = [sampler(random_logits(1, seed=s), ["b"], [params])[0] for s in range(STEPS)]
    assert a == b


def test_different_seeds_differ():
    sampler = Sampler()
    logits = [random_logits(2, seed=s) for s in range(STEPS)]
    rows = [sampler(row, ["a", "b"], [SamplingParams(seed=1), SamplingParams(seed=2)]) for row in logits]
    a, b = zip(*rows)
    assert a != b


def test_greedy_equivalents_equal_argmax(sampling_path):
    logits = random_logits(8, seed=3)
    argmax = logits.argmax(dim=-1).tolist()
    ids = [f"r{i}" for i in range(8)]
    for params in (
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=1, seed=1),
        SamplingParams(temperature=1.5, top_p=1e-6, seed=2),
        SamplingParams(temperature=1.0, top_p=1e-6),
    ):
        for _ in range(5):
            assert Sampler()(logits, ids, [params] * 8) == argmax, params


def test_greedy_on_bfloat16_logits_equals_float32_argmax(sampling_path):
    logits = random_logits(4, seed=4).bfloat16()
    assert Sampler()(logits, list("abcd"), [SamplingParams(temperature=0.0)] * 4) == logits.float().argmax(-1).tolist()


def test_top_k_restricts_to_the_k_best(sampling_path):
    # Eight good tokens with distinct probabilities, and a long tail that together outweighs them.
    logits = torch.zeros(VOCAB)
    best = [17, 3, 900, 250, 42, 512, 7, 640]
    for rank, token in enumerate(best):
        logits[token] = 4.0 - 0.25 * rank
    k = 5
    rows = 4000
    params = [SamplingParams(temperature=1.0, top_k=k)] * rows
    counts = collections.Counter(Sampler(seed=0)(logits.expand(rows, VOCAB), [f"r{i}" for i in range(rows)], params))
    assert set(counts) == set(best[:k])
    # Frequencies follow the renormalised softmax over the k best (a loose 5-sigma-ish band).
    expected = torch.softmax(logits[best[:k]], dim=0) * rows
    for token, exp in zip(best[:k], expected.tolist()):
        assert abs(counts[token] - exp) < 5 * exp**0.5 + 10, (token, counts[token], exp)


def test_top_p_keeps_the_nucleus(sampling_path):
    logits = torch.full((VOCAB,), -10.0)
    logits[[10, 20, 30]] = torch.tensor([2.0, 1.0, 0.0]).log_softmax(0) + 10  # masses ~0.67, 0.24, 0.09
    rows = 2000
    params = [SamplingParams(temperature=1.0, top_p=0.8)] * rows
    tokens = set(Sampler(seed=1)(logits.expand(rows, VOCAB), [f"r{i}" for i in range(rows)], params))
    assert tokens == {10, 20}


def test_banned_tokens_are_never_picked_greedy_or_sampled(sampling_path):
    logits = random_logits(3, seed=5)
    favourite = logits.argmax(dim=-1).tolist()
    banned = [(favourite[0],), (), tuple(logits[2].topk(10).indices.tolist())]
    ids = ["a", "b", "c"]
    greedy = Sampler()(logits.clone(), ids, [SamplingParams(temperature=0.0)] * 3, banned)
    assert greedy[0] == logits[0].topk(2).indices[1].item()  # the runner-up
    assert greedy[1] == favourite[1]
    assert greedy[2] == logits[2].topk(11).indices[10].item()
    sampler = Sampler()
    for step in range(STEPS):
        picked = sampler(logits.clone(), ids, [SamplingParams(temperature=2.0, seed=step)] * 3, banned)
        assert all(token not in row for token, row in zip(picked, banned))


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    from backend.engine.request import Request

    eos, stop = 2, 7
    request = Request("r", [5, 6], SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[stop]), (eos,))
    assert request.banned_token_ids == (eos, stop)
    request.append_token(11)
    assert request.banned_token_ids == (eos, stop)
    request.append_token(12)
    assert request.banned_token_ids == ()  # two generated: EOS and stop tokens may end it now
    ignoring = Request("i", [5], SamplingParams(min_tokens=3, ignore_eos=True, stop_token_ids=[stop]), (eos,))
    assert ignoring.banned_token_ids == (stop,)
    assert Request("n", [5], SamplingParams(), (eos,)).banned_token_ids == ()


def test_min_tokens_is_validated_and_parsed_like_max_tokens():
    import pytest

    assert SamplingParams.from_dict({"max_tokens": "16", "min_tokens": "16"}).min_tokens == 16
    for bad, message in (({"min_tokens": -1}, "min_tokens must be an integer >= 0"),
                         ({"min_tokens": 1.5}, "min_tokens must be an integer"),
                         ({"max_tokens": 4, "min_tokens": 5}, "min_tokens (5) must be <= max_tokens (4)")):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            SamplingParams.from_dict(bad)


def test_64_bit_seeds_keep_every_bit_and_larger_ones_are_refused():
    import pytest

    top = SamplingParams.from_dict({"seed": 2**64 - 1, "temperature": 1.0})
    assert top.seed == 2**64 - 1 and SamplingParams.from_dict({"seed": str(2**64 - 2)}).seed == 2**64 - 2
    picked = Sampler()(random_logits(1, seed=6), ["r"], [top])
    assert picked == Sampler()(random_logits(1, seed=6), ["q"], [top])
    with pytest.raises(ValueError, match="seed must fit in 64 bits"):
        SamplingParams.from_dict({"seed": 2**64})


# ---- the C kernel and its torch twin ---------------------------------------------------------------------------


@pytest.fixture(params=["c", "torch"])
def sampling_path(request, monkeypatch):
    """Run a test through the C kernel (where it builds) and through the torch reference."""
    if request.param == "c" and cpu_kernels.load() is None:
        pytest.skip("the C kernels do not build here")
    if request.param == "torch":
        monkeypatch.setattr(cpu_kernels, "supports_sampling", lambda logits: False)
    return request.param


TWIN_CASES = [  # (temperature, top_k, top_p)
    (0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 50, 1.0), (1.0, 0, 0.9), (1.3, 40, 0.8), (1.0, 1, 1.0),
    (1.0, 0, 1e-6), (2.0, 5000, 0.95), (0.5, 0, 0.5),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1000, 49152])
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_c_logprobs_equal_the_torch_reference(dtype, vocab, k):
    if cpu_kernels.load() is None:
        pytest.skip("the C kernels do not build here")
    gen = torch.Generator().manual_seed(vocab + k)
    rows = 12
    scale = torch.tensor([6.0 if i % 2 else 0.5 for i in range(rows + 2)])[:, None]
    logits = (torch.randn(rows + 2, vocab, generator=gen) * scale).to(dtype)  # two rows never asked
    logits[3, :7] = float("-inf")  # banned tokens: probability 0
    which = torch.tensor([i for i in range(rows + 2) if i not in (2, 9)])  # rows read out of order of the batch
    temperature = torch.tensor([1.0, 0.7, 1.3, 2.0] * 3)
    tokens = torch.randint(0, vocab, (rows,), generator=gen)
    tokens[2] = 3  # the banned row's pick is banned: -inf
    c = cpu_kernels.cpu_token_logprobs(logits, which, temperature, tokens, k)
    ref = logprob_rows(logits, which, temperature, tokens, k)
    assert torch.allclose(c[0], ref[0].float(), atol=1e-4, rtol=1e-5) and c[0][2] == float("-inf")
    assert c[1].tolist() == ref[1].tolist()
    assert torch.allclose(c[3], ref[3].float(), atol=1e-4, rtol=1e-5)
    # Each id is a distinct token whose log-probability is the one given (on ties, bf16's many, the C twin keeps the
    # first index and torch.topk any of them).
    full = torch.log_softmax(logits.index_select(0, which).float() / temperature[:, None], dim=-1)
    for row, (ids, values) in enumerate(zip(c[2].tolist(), c[3].tolist())):
        assert len(set(ids)) == len(ids) and values == sorted(values, reverse=True)
        assert torch.allclose(full[row, ids], torch.tensor(values), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1000, 49152])
def test_c_sampler_picks_what_the_torch_reference_picks(dtype, vocab):
    if cpu_kernels.load() is None:
        pytest.skip("the C kernels do not build here")
    gen = torch.Generator().manual_seed(vocab)
    rows = 4 * len(TWIN_CASES)
    # Peaked rows (a few likely tokens) and flat rows (the nucleus spans much of the vocabulary); bf16 adds ties.
    scale = torch.tensor([6.0 if i % 2 else 0.5 for i in range(rows)])[:, None]
    logits = (torch.randn(rows, vocab, generator=gen) * scale).to(dtype)
    logits[3, :7] = float("-inf")  # banned tokens
    cases = [TWIN_CASES[i % len(TWIN_CASES)] for i in range(rows)]
    temperature = torch.tensor([c[0] for c in cases])
    top_k = torch.tensor([c[1] for c in cases])
    top_p = torch.tensor([c[2] for c in cases])
    for draw in range(5):
        uniform = torch.rand(rows, generator=gen, dtype=torch.float64)
        settings = torch.stack([temperature, top_k, top_p, uniform], dim=1).double()
        c = cpu_kernels.cpu_sample_rows(logits, settings)
        ref = sample_rows(logits, settings)
        assert c.tolist() == ref.tolist(), (draw, [(i, cases[i]) for i in (c != ref).nonzero().flatten().tolist()])
        assert not set(c[3:4].tolist()) & set(range(7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_sampler_cuts_through_ties_and_plateaus(dtype):
    """Logits with a few distinct values: the top-k and top-p cuts land among thousands of tied tokens, and most of
    a row may sit at its best value (where the C quickselect cannot pivot on a sample and splits the value range)."""
    if cpu_kernels.load() is None:
        pytest.skip("the C kernels do not build here")
    gen = torch.Generator().manual_seed(11)
    vocab = 49152
    levels = torch.randint(0, 4, (6, vocab), generator=gen).float()
    levels[3:] = torch.where(torch.rand(3, vocab, generator=gen) < 0.9, 3.0, levels[3:])  # a plateau at the top
    levels[5, :100] = float("-inf")
    logits = levels.to(dtype)
    for top_k, top_p in ((0, 0.3), (0, 0.97), (5000, 1.0), (30000, 0.5), (1, 1.0), (40000, 0.999)):
        for draw in range(3):
            uniform = torch.rand(6, generator=gen, dtype=torch.float64)
            columns = [torch.full((6,), 1.0), torch.full((6,), top_k), torch.full((6,), top_p), uniform]
            settings = torch.stack(columns, 1)
            c = cpu_kernels.cpu_sample_rows(logits, settings.double())
            assert c.tolist() == sample_rows(logits, settings.double()).tolist(), (top_k, top_p, draw)


def test_c_sampler_reads_only_the_rows_it_is_given():
    if cpu_kernels.load() is None:
        pytest.skip("the C kernels do not build here")
    logits = random_logits(6, seed=8).bfloat16()[:, :999]  # strided rows
    rows = torch.tensor([4, 1])
    settings = torch.tensor([[1.0, 0, 0.9, 0.25], [0.0, 0, 1.0, 0.0]], dtype=torch.float64)  # SETTINGS' columns
    picked = cpu_kernels.cpu_sample_rows(logits, settings, rows)
    assert picked.tolist() == sample_rows(logits[rows], settings).tolist()
    assert picked[1].item() == logits[1].float().argmax().item()


def test_sampled_frequencies_follow_the_softmax(sampling_path):
    logits = torch.zeros(VOCAB)
    logits[:4] = torch.tensor([3.0, 2.0, 1.0, 0.0])
    rows = 4000
    counts = collections.Counter(Sampler(seed=3)(logits.expand(rows, VOCAB), [f"r{i}" for i in range(rows)],
                                                 [SamplingParams(temperature=1.0)] * rows))
    expected = torch.softmax(logits, dim=0) * rows
    for token in range(5):
        exp = expected[token].item()
        assert abs(counts[token] - exp) < 5 * exp**0.5 + 10, (token, counts[token], exp)


def test_the_sampler_bench_records_each_arm_beside_the_plain_step():
    from bench import sampler_options

    rows = sampler_options.sampler_step_ms([2], k=3, rounds=2)
    record = sampler_options.record_table(sampler_options.Record("python -m bench.sampler_options", {}, {}), rows)
    table = record.tables["sampler"]
    assert [c.key for c in table.columns] == ["batch", "plain", "logprobs=3", "logprobs=3_x", "penalties+bias",
                                              "penalties+bias_x"]
    row = table.rows[0]
    assert row["batch"] == 2 and row["logprobs=3_x"] == pytest.approx(row["logprobs=3"] / row["plain"])
