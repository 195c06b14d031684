"""Off-policy correction (algorithms/rollout_correction.py): weights and masks against hand-computed
values, and the mask firing for a real vLLM engine that samples at another temperature than the
trainer assumes."""
import math

import pytest
import torch

from rlfactory_megatron.algorithms.policy_losses import compute_policy_loss
from rlfactory_megatron.algorithms.rollout_correction import rollout_correction

log = math.log


def _rows():
    # row 0: token ratios pi_trainer / pi_engine = 2, 0.5, 1 (geometric mean 1), then a padded token
    # row 1: ratios 4, 4 (geometric mean 4); row 2: ratios 0.1, 0.1, 0.1 (geometric mean 0.1)
    trainer = torch.tensor([[log(0.5), log(0.2), log(0.9), 0.0],
                            [log(0.8), log(0.8), 0.0, 0.0],
                            [log(0.01), log(0.01), log(0.01), 0.0]])
    engine = torch.tensor([[log(0.25), log(0.4), log(0.9), log(0.3)],
                           [log(0.2), log(0.2), 0.0, 0.0],
                           [log(0.1), log(0.1), log(0.1), 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.float32)
    return trainer, engine, mask


def test_truncated_token_weights_are_the_capped_ratios():
    trainer, engine, mask = _rows()
    out = rollout_correction(trainer, engine, mask, tis_cap=1.5)
    expected = torch.tensor([[1.5, 0.5, 1.0, 0.0], [1.5, 1.5, 0.0, 0.0], [0.1, 0.1, 0.1, 0.0]])
    assert torch.allclose(out.token_weights, expected, atol=1e-6)
    assert out.keep.tolist() == [True, True, True]  # no band: every row stays


def test_rows_outside_the_band_are_left_out_and_padding_does_not_count():
    trainer, engine, mask = _rows()
    out = rollout_correction(trainer, engine, mask, mask_low=0.5, mask_high=2.0)
    assert out.keep.tolist() == [True, False, False]  # geometric means 1, 4 and 0.1
    # no cap: the token weights are 1 on the mask, 0 off it
    assert torch.equal(out.token_weights, mask)
    advantages = torch.full_like(mask, 2.0)
    scaled, kept_mask = out.apply(advantages, mask)
    assert torch.equal(kept_mask, torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float32))
    assert torch.equal(scaled, 2.0 * mask)


def test_off_with_no_option_and_rows_with_no_trained_token_stay():
    trainer, engine, mask = _rows()
    mask[1] = 0
    out = rollout_correction(trainer, engine, mask, mask_low=0.5, mask_high=2.0)
    assert out.keep.tolist() == [True, True, False]
    plain = rollout_correction(trainer, engine, mask)
    assert torch.equal(plain.token_weights, mask) and plain.keep.all()


def test_weighting_the_advantages_weights_each_tokens_ppo_loss():
    torch.manual_seed(0)
    log_prob = torch.randn(3, 5, requires_grad=True)
    old = log_prob.detach() + 0.3 * torch.randn(3, 5)
    advantages = torch.randn(3, 5)
    mask = torch.ones(3, 5)
    weights = torch.rand(3, 5) * 2
    weighted = compute_policy_loss("ppo", log_prob, old, advantages * weights, mask, agg_mode="token-mean")
    # by hand: each token's clipped surrogate times its weight
    ratio = (log_prob - old).exp()
    per_token = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2))
    assert torch.allclose(weighted.loss, (weights * per_token).mean(), atol=1e-6)


@pytest.mark.parametrize("engine_temperature,masked", [(1.0, False), (0.3, True)])
def test_an_engine_sampling_at_another_temperature_makes_the_mask_fire(tiny_hf_dirs, engine_temperature, masked):
    import transformers

    from rlfactory_megatron.rollout.engines import SamplingConfig, VLLMEngine

    hf_dir = tiny_hf_dirs["qwen3"]
    engine = VLLMEngine(hf_dir, max_model_len=128, max_num_seqs=16)
    try:
        prompts = [[5, 17, 42, 7], [100, 3, 9, 250, 11, 12], [61, 62], [300, 301, 302]]
        generations = engine.generate(prompts, SamplingConfig(n=4, temperature=engine_temperature, max_tokens=24, seed=3))
    finally:
        engine.close()
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    rows = [(prompt, g) for prompt, samples in zip(prompts, generations) for g in samples]
    width = max(len(g.token_ids) for _, g in rows)
    trainer = torch.zeros(len(rows), width)
    engine_lp = torch.zeros(len(rows), width)
    mask = torch.zeros(len(rows), width)
    with torch.no_grad():
        for i, (prompt, g) in enumerate(rows):
            ids = torch.tensor([prompt + g.token_ids])
            logits = model(ids).logits[0, len(prompt) - 1:-1].float()
            # The trainer assumes temperature 1 (rollout.temperature=1.0): its log-probs of the sampled tokens.
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
            n = len(g.token_ids)
            trainer[i, :n], engine_lp[i, :n], mask[i, :n] = lp, torch.tensor(g.log_probs), 1
    # A random-weight model's next-token distributions are flat, so even temperature 0.3 moves a
    # sample's geometric-mean ratio only to 0.70-1.04 (measured); a same-policy sample's is 1 +- 1e-7.
    out = rollout_correction(trainer, engine_lp, mask, mask_low=0.95, mask_high=1.05)
    masked_frac = 1 - out.keep.float().mean().item()
    if masked:
        assert masked_frac >= 0.5, masked_frac  # sampled from a sharper policy than the one trained
    else:
        assert masked_frac == 0.0 and out.log_ratio.abs().max() < 1e-3  # the same policy: ratios ~1
