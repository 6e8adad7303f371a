"""Speculative decoding's arithmetic, no engine needed: a window's verification, the
distribution its emitted tokens follow (chi-square tests, with a deterministic draft and with
rejection sampling of drawn drafts), and how many drafts a step carries."""

from __future__ import annotations

import pytest
import torch

from dolmus import SamplingParams
from dolmus.config import SpeculativeConfig
from dolmus.spec.verify import accepted_tokens

# Critical values of chi-square at p = 0.01 for 1..7 degrees of freedom.
CRITICAL = [6.635, 9.210, 11.345, 13.277, 15.086, 16.812, 18.475]


def chi_square(tokens, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of `tokens` (a list or a tensor of ids) against `probs`, and its
    degrees of freedom; a token `probs` gives no chance must never appear."""
    counts = torch.bincount(torch.as_tensor(tokens), minlength=len(probs)).double()
    support = probs > 0
    assert counts[~support].sum() == 0  # nothing the processing ruled out
    exp = probs[support].double() * len(tokens)
    return float(((counts[support] - exp) ** 2 / exp).sum()), int(support.sum()) - 1


# -- verification --------------------------------------------------------------------------


def test_all_drafts_accepted_plus_the_bonus_token():
    assert accepted_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]


def test_first_mismatch_ends_the_window_with_the_targets_token():
    assert accepted_tokens([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accepted_tokens([5, 6, 7], [4, 6, 7, 8]) == [4]


def test_no_drafts_is_a_plain_step():
    assert accepted_tokens([], [3]) == [3]


def test_verification_needs_one_sample_per_position_plus_one():
    with pytest.raises(ValueError, match="2 drafts need 3 sampled tokens"):
        accepted_tokens([1, 2], [1, 2])


# -- what a window emits --------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_p=0.95),
        SamplingParams(temperature=1.2, top_k=3),
        SamplingParams(temperature=1.0, min_p=0.05),
        SamplingParams(temperature=1.0, presence_penalty=0.8, repetition_penalty=1.3),
    ],
    ids=["top_p", "top_k", "min_p", "penalties"],
)
def test_emitted_tokens_follow_the_target_distribution(params: SamplingParams):
    """Chi-square goodness of fit over 200k windows with a deterministic draft: the first
    emitted token of a window is a plain draw from the target's processed distribution, and
    so is the second, given the first matched its draft; a token of probability 0 never
    appears."""
    from dolmus.runtime.sampler import Sampler, SamplingRow

    vocab, n = 8, 200_000
    torch.manual_seed(0)
    target = [torch.randn(vocab) * 1.5, torch.randn(vocab) * 1.5]  # positions 0 and 1 of a window
    history = [1, 2, 3, 5]  # the prompt and an output token: what penalties see
    rows = [SamplingRow(params, None, history, 3, []) for _ in range(n)]
    sampler = Sampler(torch.device("cpu"), seed=1234)
    expected = [sampler.probabilities(t.unsqueeze(0), rows[:1])[0] for t in target]
    draft = int(expected[0].argmax())  # a deterministic draft: the likeliest first token
    first = [s.token_id for s in sampler(target[0].expand(n, vocab).clone(), rows)]
    second = [s.token_id for s in sampler(target[1].expand(n, vocab).clone(), rows)]
    windows = [accepted_tokens([draft, 0], [a, b, 0]) for a, b in zip(first, second)]

    stat, dof = chi_square([w[0] for w in windows], expected[0])
    assert dof >= 1 and stat < CRITICAL[dof - 1], (stat, dof)
    given = [w[1] for w in windows if len(w) > 1]  # the first token matched the draft
    assert len(given) > 20_000
    stat, dof = chi_square(given, expected[1])
    assert dof >= 1 and stat < CRITICAL[dof - 1], (stat, dof)


def test_rejection_sampling_emits_the_target_distribution():
    """Chi-square goodness of fit over 200k windows of two drafts drawn from a draft
    distribution q unlike the target's p: the first emitted token follows p_0, the second
    (where the first draft was accepted) p_1; a token p gives no chance never appears."""
    from dolmus.spec.rejection import rejection_sample

    vocab, n = 8, 200_000
    gen = torch.Generator().manual_seed(3)
    p = (torch.randn(3, vocab, generator=gen) * 1.5).softmax(-1)
    p[0, 5] = 0.0  # impossible under the target, likely under the draft
    p = p / p.sum(-1, keepdim=True)
    q = (torch.randn(2, vocab, generator=gen) * 1.5).softmax(-1)
    q[0, 5] = 0.4
    q = q / q.sum(-1, keepdim=True)
    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=gen) for i in range(2)], 1)
    uniforms = torch.rand(n, 2, generator=gen)
    noise = torch.empty(n, 3, vocab).exponential_(generator=gen)
    emitted, count = rejection_sample(drafts, q.expand(n, 2, vocab), p.expand(n, 3, vocab), uniforms, noise)
    stat, dof = chi_square(emitted[:, 0], p[0])
    assert stat < CRITICAL[dof - 1], (stat, dof)
    second = emitted[count >= 2, 1]
    assert len(second) > 20_000
    stat, dof = chi_square(second, p[1])
    assert stat < CRITICAL[dof - 1], (stat, dof)
    # q = p: every draft is accepted, and the bonus token ends the window
    same, count = rejection_sample(drafts, p[:2].expand(n, 2, vocab), p.expand(n, 3, vocab), uniforms, noise)
    assert bool((count[drafts[:, 0] != 5] == 3).all())


# -- how many drafts a step carries ------------------------------------------------------------


def _costs(seconds_of, bases=(1, 8, 32)):
    """Step costs measured at a few draft counts for each plain size: seconds_of(tokens)."""
    from dolmus.spec.policy import StepCosts

    costs = StepCosts()
    for base in bases:
        for drafts in (0, 1, 2, 4, 8, 16, 32, 64, 128):
            costs.observe(base, drafts, seconds_of(base + drafts))
    return costs


def test_step_costs_interpolate_between_measured_draft_counts_of_one_size():
    from dolmus.spec.policy import StepCosts

    costs = StepCosts()
    assert costs.estimate(4, 0) is None
    costs.observe(4, 2, 0.010)
    costs.observe(4, 6, 0.030)
    costs.observe(8, 0, 0.050)  # another size: never mixed in
    assert costs.estimate(4, 2) == 0.010 and costs.estimate(4, 6) == 0.030
    assert costs.estimate(4, 3) == pytest.approx(0.015)
    assert costs.estimate(4, 0) is None and costs.estimate(4, 7) is None  # outside what was measured
    costs.observe(4, 6, 0.040)  # a moving average, not the latest alone
    assert 0.030 < costs.estimate(4, 6) < 0.040


def test_drafts_go_where_a_step_is_bound_by_reading_weights_and_not_where_by_compute():
    from dolmus.spec.policy import draft_length

    weights_bound = _costs(lambda n: 0.020 + 0.0002 * n)  # a few rows cost what one does
    compute_bound = _costs(lambda n: 0.001 * n)  # every row costs as much as the others
    assert draft_length(weights_bound, 1, 0, 1.0, 0.6, 4, 2) == 4
    assert draft_length(weights_bound, 32, 0, 32.0, 0.6, 4, 2) in (1, 2, 3, 4)
    assert draft_length(compute_bound, 1, 0, 1.0, 0.9, 4, 2) == 0
    assert draft_length(compute_bound, 32, 0, 32.0, 0.9, 4, 2) == 0
    assert draft_length(weights_bound, 1, 0, 1.0, 0.0, 4, 2) == 0  # drafts that are never accepted
    assert draft_length(weights_bound, 8, 126, 9.0, 0.9, 4, 2) == 2  # windows never measured: the fallback
    assert draft_length(weights_bound, 9, 0, 9.0, 0.9, 4, 2) == 0  # a size never measured without drafts
    assert draft_length(weights_bound, 1, 0, 1.0, 0.9, 0, 2) == 0


def test_a_busy_scheduler_stops_drafting_by_the_measured_costs():
    """Eight decodes whose steps cost as much per token as they carry get no drafts; the
    same decodes on steps that cost what one row does get full windows."""
    from dolmus.engine.kv_cache import KVCacheManager
    from dolmus.engine.request import Request
    from dolmus.engine.scheduler import Scheduler
    from dolmus.step import StepResult

    def windows(seconds_of) -> tuple[list[int], dict[str, int]]:
        kv = KVCacheManager(num_blocks=256, block_size=4, enable_prefix_caching=False)
        sched = Scheduler(kv, 8, 256, 500, speculative=SpeculativeConfig(num_speculative_tokens=4))
        for i in range(8):
            params = SamplingParams(max_tokens=100, ignore_eos=True)
            sched.add(Request(f"r{i}", [1, 2, 3] * 5, params, [0], 100))
        out = sched.schedule()  # the prefills
        sched.update(out, StepResult({item.request.request_id: [1] for item in out.scheduled}))
        sched.drafts.step_costs = _costs(seconds_of)  # measured at 8 plain tokens among others
        out = sched.schedule()
        return [len(item.drafts) for item in out.scheduled], sched.spec_stats.fallbacks

    assert windows(lambda n: 0.001 * n) == ([0] * 8, {"cost": 8, "memory": 0})
    assert windows(lambda n: 0.020 + 0.00001 * n) == ([4] * 8, {"cost": 0, "memory": 0})


def test_draft_length_adapts_to_a_requests_acceptance():
    from dolmus.engine.kv_cache import KVCacheManager
    from dolmus.engine.request import Request
    from dolmus.engine.scheduler import Scheduler
    from dolmus.step import StepResult

    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    spec = SpeculativeConfig(num_speculative_tokens=4, adaptive=False)  # no step times here
    sched = Scheduler(kv, 4, 64, 500, speculative=spec)
    request = Request("r", [1, 2, 3] * 5, SamplingParams(max_tokens=100, ignore_eos=True), [0], 100)
    sched.add(request)
    lengths = []
    for _ in range(6):
        out = sched.schedule()
        item = out.scheduled[0]
        lengths.append(len(item.drafts))
        # The target never agrees with a draft: each step yields one token, never a match...
        sched.update(out, StepResult({"r": [7 if not item.drafts else item.drafts[0] + 1]}))
        # ... which is then put back on the 1 2 3 cycle, so the proposer keeps finding drafts.
        cycle = item.drafts[0] if item.drafts else 1
        request.all_token_ids[-1] = request.output_token_ids[-1] = cycle
    assert lengths[0] == 0 and lengths[1] == 2  # the prefill step, then the prior's share of a window
    assert lengths[1:] == sorted(lengths[1:], reverse=True) and lengths[-1] == 1
    assert request.num_draft_tokens == sum(lengths) and request.num_accepted_tokens == 0
