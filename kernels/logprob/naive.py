"""Reference log-prob/entropy: full fp32 logits -> log_softmax -> gather (what the fused path avoids)."""
import torch


def naive_logprob_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [T, H], full weight [V, H], targets [T] -> (log p(target) [T], entropy [T]), fp32 or wider."""
    logits = hidden @ weight.t()
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # fp64 stays fp64
    log_probs = torch.log_softmax(logits, dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs.gather(-1, targets[:, None].long()).squeeze(-1), entropy
