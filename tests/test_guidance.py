"""The guidance refinements of ``genrl.math.guidance`` against their formulas, sample by sample."""

import torch

from genrl.math.guidance import renormalized_guidance, truncated_guidance_scale


def test_truncation_guides_until_the_progress_passes_it():
    progress = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0])
    assert truncated_guidance_scale(4.0, progress, 0.5).tolist() == [4.0, 4.0, 4.0, 0.0, 0.0]
    assert truncated_guidance_scale(4.0, progress, 1.0).tolist() == [4.0] * 5  # the pipelines' default: every step
    assert truncated_guidance_scale(4.0, progress, -0.1).tolist() == [0.0] * 5


def test_renormalization_caps_each_sample_at_its_own_conditional_norm():
    conditional = torch.tensor([[3.0, 4.0], [0.6, 0.8]]).view(2, 1, 2)  # norms 5 and 1
    guided = torch.tensor([[6.0, 8.0], [0.3, 0.4]]).view(2, 1, 2)  # norms 10 and 0.5
    capped = renormalized_guidance(guided, conditional, 1.0)
    torch.testing.assert_close(capped[0], guided[0] / 2)  # 10 > 5: scaled down to norm 5, same direction
    torch.testing.assert_close(capped[1], guided[1])  # 0.5 <= 1: kept
    torch.testing.assert_close(renormalized_guidance(guided, conditional, 1.5)[0], guided[0] * 0.75)
    assert torch.equal(renormalized_guidance(guided, conditional, 0.0), guided)  # 0: off
