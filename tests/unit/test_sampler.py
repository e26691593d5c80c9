import math

import pytest
import torch

from tokenmill.engine.core.sampler import Sampler
from tokenmill.sampling_params import SamplingParams
from tokenmill.sequence import Sequence

EOS = 3


def make_seq(prompt=(0,), output=(), index=0, **params) -> Sequence:
    seq = Sequence("r", list(prompt), SamplingParams(**params), index=index)
    for t in output:
        seq.append_token(t)
    return seq


def draw_many(logits_row: list[float], n: int, **params) -> torch.Tensor:
    """n independent draws from one row of logits, as a batch of n sequences."""
    torch.manual_seed(1234)
    logits = torch.tensor([logits_row] * n)
    seqs = [make_seq(**params) for _ in range(n)]
    return torch.tensor(Sampler([EOS])(logits, seqs).token_ids)


def test_greedy_is_argmax_and_leaves_logits_untouched():
    logits = torch.randn(8, 100)
    before = logits.clone()
    seqs = [make_seq(temperature=0.0) for _ in range(8)]
    out = Sampler([EOS])(logits, seqs)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 8
    assert torch.equal(logits, before)


def test_greedy_rows_mixed_with_random_rows_stay_argmax():
    logits = torch.randn(6, 50)
    seqs = [make_seq(temperature=0.0 if i % 2 == 0 else 1.0, top_p=0.9) for i in range(6)]
    out = Sampler([EOS])(logits, seqs)
    assert out.token_ids[0::2] == logits[0::2].argmax(-1).tolist()


def test_temperature_sampling_matches_softmax_frequencies():
    row = [1.0, 0.5, 0.0, -1.0]
    temperature = 0.7
    tokens = draw_many(row, 8000, temperature=temperature)
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    expected = torch.softmax(torch.tensor(row) / temperature, dim=-1)
    # binomial std is at most 0.006 at n=8000: 0.03 cannot flake
    assert torch.allclose(freq, expected, atol=0.03), (freq, expected)


@pytest.mark.parametrize("params", [{}, {"top_k": 3}, {"top_p": 0.5}, {"min_p": 0.2}])
def test_temperature_one_samples_like_any_temperature_and_leaves_logits_untouched(params):
    """Temperature 1.0 skips the division: the same draws as a temperature a hair away
    from 1 (the same uniforms, nearly the same distribution), the filters still apply,
    and the caller's logits are not written."""
    torch.manual_seed(3)
    logits = torch.randn(64, 40) * 2
    before = logits.clone()

    def draw(temperature):
        torch.manual_seed(99)
        seqs = [make_seq(temperature=temperature, **params) for _ in range(64)]
        return Sampler([EOS])(logits, seqs).token_ids

    at_one = draw(1.0)
    assert torch.equal(logits, before)
    near = draw(1.0 + 1e-6)
    assert sum(a != b for a, b in zip(at_one, near)) <= 1  # a draw on a boundary at most
    if "top_k" in params:
        allowed = logits.topk(3, dim=-1).indices
        assert all(t in allowed[i].tolist() for i, t in enumerate(at_one))


def test_top_k_never_samples_outside_the_k_largest():
    torch.manual_seed(0)
    row = torch.randn(50).tolist()
    allowed = set(torch.tensor(row).topk(5).indices.tolist())
    tokens = set(draw_many(row, 2000, top_k=5).tolist())
    assert tokens <= allowed
    assert len(tokens) > 1


def test_top_p_keeps_the_smallest_set_reaching_p():
    row = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist()
    tokens = draw_many(row, 2000, top_p=0.75)
    assert set(tokens.tolist()) == {0, 1}


def test_top_p_on_a_flat_large_vocab_never_samples_the_tail():
    # flat enough that the kept set is larger than the first candidate tier
    torch.manual_seed(0)
    row = (torch.randn(5000) * 0.5).tolist()
    probs = torch.softmax(torch.tensor(row), -1)
    sorted_probs, order = probs.sort(descending=True)
    num_kept = int((sorted_probs.cumsum(0) < 0.9).sum()) + 1
    assert num_kept > 256
    allowed = set(order[:num_kept].tolist())
    tokens = set(draw_many(row, 500, top_p=0.9).tolist())
    assert tokens <= allowed


def test_min_p_drops_tokens_below_fraction_of_max():
    row = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist()
    tokens = draw_many(row, 2000, min_p=0.2)  # threshold 0.1: token 3 is out
    assert set(tokens.tolist()) == {0, 1, 2}


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    sampler = Sampler([EOS])
    # token 0 seen in the prompt: 2.0 / 2 = 1.0 falls below token 1's 1.5
    logits = torch.tensor([[2.0, 1.5, -5.0, -5.0]])
    assert sampler(logits, [make_seq(prompt=[0], temperature=0, repetition_penalty=2.0)]
                   ).token_ids == [1]
    # token 0 seen in the output: -1.0 * 2 = -2.0 falls below token 1's -1.5
    logits = torch.tensor([[-1.0, -1.5, -5.0, -5.0]])
    seq = make_seq(prompt=[2], output=[0], temperature=0, repetition_penalty=2.0)
    assert sampler(logits, [seq]).token_ids == [1]
    # unseen tokens are not penalized
    seq = make_seq(prompt=[2], output=[2], temperature=0, repetition_penalty=2.0)
    assert sampler(logits, [seq]).token_ids == [0]


@pytest.mark.parametrize("rival, winner", [(0.45, 1), (0.35, 0)])
def test_frequency_and_presence_penalties_subtract_per_output_count(rival, winner):
    # token 0 generated 3 times: 2.0 - 3 * 0.5 - 0.1 = 0.4
    logits = torch.tensor([[2.0, rival, -5.0, -5.0]])
    seq = make_seq(prompt=[1, 1, 1], output=[0, 0, 0], temperature=0,
                   frequency_penalty=0.5, presence_penalty=0.1)
    assert Sampler([EOS])(logits, [seq]).token_ids == [winner]


def test_presence_and_frequency_ignore_prompt_tokens():
    logits = torch.tensor([[2.0, 1.9, -5.0, -5.0]])
    seq = make_seq(prompt=[0, 0, 0], output=[2], temperature=0,
                   frequency_penalty=2.0, presence_penalty=2.0)
    assert Sampler([EOS])(logits, [seq]).token_ids == [0]


def test_min_tokens_blocks_eos_and_stop_token_ids_until_reached():
    sampler = Sampler([EOS])
    logits = torch.tensor([[0.0, 1.0, 9.0, 10.0]])  # EOS=3 best, stop id 2 next
    early = make_seq(output=[1], temperature=0, min_tokens=2, stop_token_ids=[2])
    assert sampler(logits, [early]).token_ids == [1]
    done = make_seq(output=[1, 1], temperature=0, min_tokens=2, stop_token_ids=[2])
    assert sampler(logits, [done]).token_ids == [EOS]
    # sampled rows too: EOS holds almost all the mass, yet never comes out
    tokens = draw_many([0.0, 0.0, 0.0, 20.0], 500, min_tokens=1)
    assert EOS not in tokens.tolist()


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    torch.manual_seed(0)
    steps, vocab = 20, 64
    logits = [torch.randn(1, vocab) for _ in range(steps)]

    def run(with_neighbours: bool) -> list[int]:
        seq = make_seq(seed=42, temperature=1.0, top_p=0.95)
        tokens = []
        for step in range(steps):
            batch, seqs = logits[step], [seq]
            if with_neighbours:
                noise = torch.randn(5, vocab)
                batch = torch.cat([noise[:2], logits[step], noise[2:]])
                seqs = [make_seq(temperature=1.5, top_k=10) for _ in range(2)] + [seq] + [
                    make_seq(temperature=0.8, repetition_penalty=1.3, output=[1, 2])
                    for _ in range(3)]
            tok = Sampler([EOS])(batch, seqs).token_ids[seqs.index(seq)]
            seq.append_token(tok)
            tokens.append(tok)
        return tokens

    alone = run(False)
    assert run(True) == alone
    assert len(set(alone)) > 3


def test_seeded_samples_of_one_request_differ_but_reproduce():
    logits = torch.zeros(1, 1000)

    def draws(index: int) -> list[int]:
        seq = make_seq(seed=7, index=index)
        return [Sampler()(logits, [seq]).token_ids[0] for _ in range(5)]

    assert draws(0) == draws(0)
    assert draws(0) != draws(1)


@pytest.mark.parametrize("params", [
    {"temperature": 0.0},
    {"temperature": 0.5, "top_k": 3, "repetition_penalty": 1.5},
])
def test_logprobs_are_the_models_log_softmax_with_rank(params):
    torch.manual_seed(0)
    logits = torch.randn(3, 40)
    seqs = [make_seq(logprobs=4, output=[5], **params), make_seq(**params),
            make_seq(logprobs=0, **params)]
    out = Sampler([EOS])(logits, seqs)
    expected = torch.log_softmax(logits, -1)
    order = expected[0].argsort(descending=True).tolist()

    lp = out.logprobs[0]
    chosen = out.token_ids[0]
    assert chosen in lp
    assert math.isclose(lp[chosen].logprob, expected[0, chosen].item(), abs_tol=1e-5)
    assert lp[chosen].rank == order.index(chosen) + 1
    top = [t for t in lp if lp[t].rank <= 4]
    assert sorted(top, key=lambda t: lp[t].rank) == order[:4]
    for t, entry in lp.items():
        assert math.isclose(entry.logprob, expected[0, t].item(), abs_tol=1e-5)
    assert len(lp) in (4, 5)

    assert out.logprobs[1] is None
    assert list(out.logprobs[2]) == [out.token_ids[2]]


def test_one_device_to_host_copy_per_step(monkeypatch):
    """Ids and requested logprobs come back packed in one tensor: one .cpu() call
    for a batch mixing greedy, seeded top-p and logprob rows."""
    calls = []
    cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: calls.append(t.shape) or cpu(t))
    logits = torch.randn(4, 300)
    seqs = [make_seq(temperature=0.0, logprobs=2), make_seq(temperature=0.9, top_p=0.8, seed=7),
            make_seq(temperature=1.0, logprobs=0), make_seq(temperature=0.0)]
    out = Sampler([EOS])(logits, seqs)
    assert len(calls) == 1
    assert out.token_ids[0] == int(logits[0].argmax()) and len(out.logprobs[0]) >= 2
    lp = torch.log_softmax(logits[2], -1)
    tok = out.token_ids[2]
    assert out.logprobs[2][tok].logprob == pytest.approx(float(lp[tok]))
    assert out.logprobs[2][tok].rank == int((lp > lp[tok]).sum()) + 1
    assert out.logprobs[1] is None and out.logprobs[3] is None
