"""Write your own token weighting: subclass TokenMask, implement weigh(stats), register it.

The strategy below softens the push of unlikely mistakes: a negative-advantage token of probability
p < floor gets weight p / floor (1 elsewhere), so the loss of the policy's least likely wrong tokens
counts less, smoothly, instead of being silenced. Registered strategies are available to configs
(`mask.name: soft_negatives`) and to `stapo masks --import examples/custom_weighting.py`.

    stapo train --import examples/custom_weighting.py mask.name=soft_negatives trainer.total_steps=20 \
        trainer.output_dir=outputs/tiny_soft_negatives
"""

import torch

from stapo.losses import TokenMask, TokenStats, register_mask


@register_mask("soft_negatives")
class SoftNegatives(TokenMask):
    """Weight negative-advantage tokens of probability p < floor by p / floor."""

    floor: float = 0.05

    def weigh(self, stats: TokenStats) -> torch.Tensor:
        soft = (stats.logprobs.exp() / self.floor).clamp(max=1.0)  # (B, T), in [0, 1]
        return torch.where(stats.advantages_bt < 0, soft, torch.ones_like(soft))
