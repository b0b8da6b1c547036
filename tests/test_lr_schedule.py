"""--lr_step_rules count optimizer steps, however many processes step the scheduler."""

import pytest
import torch
from diffusers.optimization import get_scheduler

from genrl.training.lr_schedule import parse_step_rules, scheduler_step_rules


def test_rules_parse_into_multipliers_below_each_boundary():
    assert parse_step_rules("1:200,0.5") == ([(1.0, 200)], 0.5)
    assert parse_step_rules("1:10, 0.1:20 ,0.01") == ([(1.0, 10), (0.1, 20)], 0.01)
    assert parse_step_rules("0.5") == ([], 0.5)


@pytest.mark.parametrize("rules", ["1:200", "a:1,1", "1:20,1:10,0.5", "1:0,1", "-1:5,1", "1:5,-0.5", ""])
def test_malformed_rules_are_one_sentence_naming_the_form(rules):
    with pytest.raises(ValueError) as error:
        parse_step_rules(rules)
    message = str(error.value)
    assert message.startswith(f"--lr_step_rules {rules!r} ") and '"m1:s1,m2:s2,...,m_last"' in message
    assert "\n" not in message


@pytest.mark.parametrize("per_step", [1, 2, 4])
def test_the_rate_changes_at_the_optimizer_step_the_rules_name(per_step):
    # Step the scheduler as Accelerate does: once per process for every optimizer step
    # (tests/test_train_distributed.py checks it under DDP, ZeRO-2 and ZeRO-3).
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = get_scheduler("piecewise_constant", optimizer=optimizer, step_rules=scheduler_step_rules("1:3,0.5:5,0.25", per_step))
    rates = []
    for _ in range(7):  # the rate each optimizer step runs with, then the step
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        for _ in range(per_step):
            scheduler.step()
    assert rates == pytest.approx([0.1, 0.1, 0.1, 0.05, 0.05, 0.025, 0.025])
