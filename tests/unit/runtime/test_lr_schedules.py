# SPDX-License-Identifier: Apache-2.0
"""LR schedules against closed-form formulas written from each schedule's documented definition.

Convention: ``lrs[0]`` is the rate written at construction; ``lrs[k]`` (k >= 1) the rate after
the k-th ``step()``, i.e. for ``last_batch_iteration = k - 1``.
"""

import math

import pytest
import torch

from deepspeed.runtime import lr_schedules
from deepspeed.runtime.lr_schedules import (VALID_LR_SCHEDULES, LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR,
                                            WarmupLR, get_lr_scheduler_from_config)

STEPS = 24
BASE_LRS = (0.2, 0.05)


def make_optimizer(kind='adam', lrs=BASE_LRS):
    groups = [{'params': [torch.nn.Parameter(torch.zeros(2))], 'lr': lr} for lr in lrs]
    if kind == 'sgd':
        return torch.optim.SGD(groups, lr=lrs[0], momentum=0.9)
    return torch.optim.Adam(groups, lr=lrs[0])


def trace(schedule, steps=STEPS):
    """Group learning rates at construction and after each of ``steps`` steps."""
    lrs = [[g['lr'] for g in schedule.optimizer.param_groups]]
    for _ in range(steps):
        schedule.step()
        lrs.append([g['lr'] for g in schedule.optimizer.param_groups])
        assert schedule.get_last_lr() == pytest.approx(lrs[-1])
    return lrs


def assert_trace(actual, expected):
    assert len(actual) == len(expected)
    for k, (got, want) in enumerate(zip(actual, expected)):
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15), f'lr mismatch at entry {k}'


# --- reference formulas ------------------------------------------------------------------------


def warmup_gamma(t, warmup_steps, warmup_type):
    """Fraction of warmup done after batch t: log(t+1)/log(W) or t/W, with W = max(2, warmup_steps)."""
    w = max(2, warmup_steps)
    if t >= w:
        return 1.0
    return math.log(t + 1) / math.log(w) if warmup_type == 'log' else t / w


def ref_warmup(lo, hi, warmup_steps, warmup_type, steps=STEPS):
    return [lo] + [lo + (hi - lo) * warmup_gamma(t, warmup_steps, warmup_type) for t in range(steps)]


def ref_warmup_decay(lo, hi, warmup_steps, total, warmup_type, steps=STEPS):
    w = max(2, warmup_steps)
    out = [lo]
    for t in range(steps):
        gamma = warmup_gamma(t, warmup_steps, warmup_type) if t < w else max(0.0, (total - t) / max(1, total - w))
        out.append(lo + (hi - lo) * gamma)
    return out


def ref_warmup_cosine(base, total, warmup_min_ratio, warmup_steps, cos_min_ratio, warmup_type, steps=STEPS):
    w = max(2, warmup_steps)
    out = [0.0]
    for t in range(steps):
        if t < w:
            ratio = warmup_min_ratio + (1 - warmup_min_ratio) * warmup_gamma(t, warmup_steps, warmup_type)
        else:
            progress = min(1.0, (t - w + 1) / max(1, total - w))
            ratio = max(0.0, cos_min_ratio + (1 - cos_min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
        out.append(base * ratio)
    return out


def ref_range_test(min_lr, step_size, step_rate, staircase, steps=STEPS):
    out = [min_lr]
    for t in range(steps):
        n = (t + 1) / step_size
        out.append(min_lr * (1 + step_rate * (math.floor(n) if staircase else n)))
    return out


def one_cycle_height(i, up, down, up_stairs, down_stairs):
    """Triangle height in [0, 1] at integer position i: rises over `up` batches, falls over `down`."""
    pos = i % (up + down)
    rise, length, stairs = (pos, up, up_stairs) if pos <= up else (up + down - pos, down, down_stairs)
    if stairs > 0:
        return (rise * stairs // length) / stairs  # integer floor: the stair index is exact
    return rise / length


def ref_one_cycle(lo,
                  hi,
                  up,
                  down,
                  up_stairs,
                  down_stairs,
                  decay_rate,
                  decay_size,
                  mom_lo,
                  mom_hi,
                  mom_decay,
                  steps=STEPS):
    lrs, moms = [lo], [mom_lo]
    for t in range(steps):
        if t < up + down:
            h = one_cycle_height(t + 1, up, down, up_stairs, down_stairs)
            lrs.append(lo + (hi - lo) * h)
            moms.append(mom_hi - (mom_hi - mom_lo) * h)
        else:
            k = (t - (up + down) + 1) / decay_size if decay_size else 0.0
            lrs.append(lo / (1 + decay_rate * k))
            moms.append(mom_hi * (1 + mom_decay * k))
    return lrs, moms


# --- schedules ---------------------------------------------------------------------------------


@pytest.mark.parametrize('warmup_type', ['log', 'linear'])
@pytest.mark.parametrize('warmup_steps', [1, 7])
def test_warmup_lr(warmup_type, warmup_steps):
    schedule = WarmupLR(make_optimizer(),
                        warmup_min_lr=[0.01, 0.0],
                        warmup_max_lr=[0.3, 0.1],
                        warmup_num_steps=warmup_steps,
                        warmup_type=warmup_type)
    expected = zip(ref_warmup(0.01, 0.3, warmup_steps, warmup_type), ref_warmup(0.0, 0.1, warmup_steps, warmup_type))
    assert_trace(trace(schedule), [list(e) for e in expected])


def test_warmup_lr_defaults_to_optimizer_lr():
    schedule = WarmupLR(make_optimizer(lrs=(0.4, 0.4)), warmup_num_steps=5)
    assert_trace(trace(schedule), [[v, v] for v in ref_warmup(0.0, 0.4, 5, 'log')])
    # each param group warms up to its own learning rate (upstream's rule since it stopped using group 0's)
    schedule = WarmupLR(make_optimizer(lrs=(0.4, 0.1)), warmup_num_steps=5)
    assert schedule.max_lrs == [0.4, 0.1]
    assert_trace(trace(schedule),
                 [[a, b] for a, b in zip(ref_warmup(0.0, 0.4, 5, 'log'), ref_warmup(0.0, 0.1, 5, 'log'))])


@pytest.mark.parametrize('warmup_type', ['log', 'linear'])
@pytest.mark.parametrize('total', [15, 3])
def test_warmup_decay_lr(warmup_type, total):
    schedule = WarmupDecayLR(make_optimizer(),
                             total_num_steps=total,
                             warmup_min_lr=0.02,
                             warmup_max_lr=0.2,
                             warmup_num_steps=6,
                             warmup_type=warmup_type)
    assert_trace(trace(schedule), [[v, v] for v in ref_warmup_decay(0.02, 0.2, 6, total, warmup_type)])


@pytest.mark.parametrize('warmup_type', ['log', 'linear'])
@pytest.mark.parametrize('total', [18, 4])
def test_warmup_cosine_lr(warmup_type, total):
    schedule = WarmupCosineLR(make_optimizer(),
                              total_num_steps=total,
                              warmup_min_ratio=0.1,
                              warmup_num_steps=5,
                              cos_min_ratio=0.05,
                              warmup_type=warmup_type)
    refs = [ref_warmup_cosine(base, total, 0.1, 5, 0.05, warmup_type) for base in BASE_LRS]
    assert_trace(trace(schedule), [list(e) for e in zip(*refs)])


@pytest.mark.parametrize('staircase', [False, True])
def test_lr_range_test(staircase):
    schedule = LRRangeTest(make_optimizer(),
                           lr_range_test_min_lr=[1e-3, 2e-3],
                           lr_range_test_step_size=4,
                           lr_range_test_step_rate=0.5,
                           lr_range_test_staircase=staircase)
    refs = [ref_range_test(m, 4, 0.5, staircase) for m in (1e-3, 2e-3)]
    assert_trace(trace(schedule), [list(e) for e in zip(*refs)])


@pytest.mark.parametrize('up,down,up_stairs,down_stairs', [(4, 4, 0, None), (4, 6, 0, None), (4, 6, 2, 3),
                                                           (6, 3, 3, None)])
@pytest.mark.parametrize('decay_size', [0, 2])
def test_one_cycle(up, down, up_stairs, down_stairs, decay_size):
    schedule = OneCycle(make_optimizer(),
                        cycle_min_lr=0.01,
                        cycle_max_lr=0.1,
                        decay_lr_rate=0.5,
                        cycle_first_step_size=up,
                        cycle_second_step_size=down,
                        cycle_first_stair_count=up_stairs,
                        cycle_second_stair_count=down_stairs,
                        decay_step_size=decay_size,
                        cycle_min_mom=0.85,
                        cycle_max_mom=0.95,
                        decay_mom_rate=0.01)
    second_stairs = up_stairs if down_stairs is None else down_stairs
    lrs, moms = ref_one_cycle(0.01, 0.1, up, down, up_stairs, second_stairs, 0.5, decay_size, 0.85, 0.95, 0.01)
    got_moms = [[g['betas'] for g in schedule.optimizer.param_groups]]
    got_lrs = [[g['lr'] for g in schedule.optimizer.param_groups]]
    for _ in range(STEPS):
        schedule.step()
        got_lrs.append([g['lr'] for g in schedule.optimizer.param_groups])
        got_moms.append([g['betas'] for g in schedule.optimizer.param_groups])
    assert_trace(got_lrs, [[v, v] for v in lrs])
    assert_trace([[b[0] for b in row] for row in got_moms], [[m, m] for m in moms])
    assert all(b[1] == 0.99 for row in got_moms for b in row)


def test_one_cycle_without_betas_leaves_momentum_alone():
    optimizer = make_optimizer('sgd')
    schedule = OneCycle(optimizer, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=3)
    assert schedule.cycle_momentum is False
    schedule.step()
    assert all(g['momentum'] == 0.9 and 'betas' not in g for g in optimizer.param_groups)


# --- shared behaviour --------------------------------------------------------------------------

SCHEDULES = {
    'WarmupLR': lambda opt: WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=6),
    'WarmupDecayLR': lambda opt: WarmupDecayLR(opt, total_num_steps=12, warmup_max_lr=0.1, warmup_num_steps=4),
    'WarmupCosineLR': lambda opt: WarmupCosineLR(opt, total_num_steps=12, warmup_num_steps=4),
    'OneCycle': lambda opt: OneCycle(opt, 0.01, 0.1, cycle_first_step_size=3, decay_lr_rate=0.1, decay_step_size=2),
    'LRRangeTest': lambda opt: LRRangeTest(opt, lr_range_test_step_size=3, lr_range_test_step_rate=2.0),
}


@pytest.mark.parametrize('name', sorted(SCHEDULES))
def test_state_dict_round_trip(name):
    straight = SCHEDULES[name](make_optimizer())
    expected = trace(straight, 16)

    first = SCHEDULES[name](make_optimizer())
    head = trace(first, 7)
    saved = first.state_dict()
    assert saved == {'last_batch_iteration': 6}
    resumed_optimizer = make_optimizer()
    resumed = SCHEDULES[name](resumed_optimizer)
    resumed.load_state_dict(saved)
    tail = trace(resumed, 9)[1:]
    assert_trace(head + tail, expected)


@pytest.mark.parametrize('name', sorted(SCHEDULES))
def test_explicit_iteration_and_plain_param_groups(name):
    """Works on any object exposing param_groups; step(i) jumps to batch i."""

    class Wrapper:

        def __init__(self, inner):
            self.param_groups = inner.param_groups

    reference = SCHEDULES[name](make_optimizer())
    expected = trace(reference, 10)[10]
    wrapped = SCHEDULES[name](Wrapper(make_optimizer()))
    wrapped.step(9)
    assert wrapped.last_batch_iteration == 9
    assert_trace([[g['lr'] for g in wrapped.optimizer.param_groups]], [expected])


@pytest.mark.parametrize('name', sorted(SCHEDULES))
def test_get_lr_is_pure_and_last_lr_before_step(name):
    optimizer = make_optimizer()
    schedule = SCHEDULES[name](optimizer)
    first = schedule.get_lr()
    assert schedule.get_lr() == first and schedule.last_batch_iteration == -1
    # Constructed to resume (last_batch_iteration != -1), a schedule leaves the optimizer alone.
    untouched = make_optimizer()
    cls = type(schedule)
    kwargs = {'last_batch_iteration': 5}
    if name in ('WarmupDecayLR', 'WarmupCosineLR'):
        kwargs['total_num_steps'] = 12
    if name == 'OneCycle':
        kwargs.update(cycle_min_lr=0.01, cycle_max_lr=0.1)
    resumed = cls(untouched, **kwargs)
    assert [g['lr'] for g in untouched.param_groups] == list(BASE_LRS)
    with pytest.raises(AssertionError, match='need to call step'):
        resumed.get_last_lr()


def test_tensor_lr_is_updated_in_place():
    optimizer = make_optimizer(lrs=(0.1, ))
    lr = torch.tensor(0.1)
    optimizer.param_groups[0]['lr'] = lr
    schedule = WarmupLR(optimizer, warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=4, warmup_type='linear')
    schedule.step()
    schedule.step()
    assert optimizer.param_groups[0]['lr'] is lr
    assert float(lr) == pytest.approx(0.1 * 1 / 4)
    assert schedule.get_last_lr() == pytest.approx([0.025])


def test_validation():
    with pytest.raises(ValueError):
        WarmupLR(make_optimizer(), warmup_num_steps=0)
    with pytest.raises(ValueError):
        WarmupCosineLR(make_optimizer(), total_num_steps=10, warmup_num_steps=2.5)
    with pytest.raises(ValueError, match='one per param group'):
        WarmupLR(make_optimizer(), warmup_max_lr=[0.1, 0.2, 0.3])
    with pytest.raises(TypeError):
        WarmupLR(object())
    for bad in (0, -5):  # it divides the step index
        with pytest.raises(ValueError, match='lr_range_test_step_size'):
            LRRangeTest(make_optimizer(), lr_range_test_step_size=bad)


def test_from_config():
    assert VALID_LR_SCHEDULES == ['LRRangeTest', 'OneCycle', 'WarmupLR', 'WarmupDecayLR', 'WarmupCosineLR']
    assert (lr_schedules.WARMUP_MIN_LR, lr_schedules.WARMUP_MAX_LR) == ('warmup_min_lr', 'warmup_max_lr')
    optimizer = make_optimizer()
    params = {'warmup_min_lr': 0.0, 'warmup_max_lr': 0.1, 'warmup_num_steps': 3, 'warmup_type': 'linear'}
    schedule = get_lr_scheduler_from_config(optimizer, 'WarmupLR', params)
    assert type(schedule) is WarmupLR and schedule.warmup_num_steps == 3 and schedule.max_lrs == [0.1, 0.1]
    decay = get_lr_scheduler_from_config(optimizer, 'WarmupDecayLR', {'total_num_steps': 9})
    assert type(decay) is WarmupDecayLR and decay.total_num_steps == 9
    step_lr = get_lr_scheduler_from_config(optimizer, 'StepLR', {'step_size': 2})
    assert isinstance(step_lr, torch.optim.lr_scheduler.StepLR)
    with pytest.raises(ValueError, match='Unknown LR scheduler'):
        get_lr_scheduler_from_config(optimizer, 'NoSuchSchedule', {})
    with pytest.raises(ValueError, match='warmup_num_steps'):
        get_lr_scheduler_from_config(optimizer, 'WarmupLR', {'warmup_num_steps': 'auto'})


def test_command_line_helpers():
    import argparse
    parser = lr_schedules.add_tuning_arguments(argparse.ArgumentParser())
    args = parser.parse_args(['--lr_schedule', 'WarmupLR', '--warmup_max_lr', '0.5'])
    config, error = lr_schedules.get_config_from_args(args)
    assert error is None and config['type'] == 'WarmupLR'
    assert config['params'] == {
        'warmup_min_lr': 0,
        'warmup_max_lr': 0.5,
        'warmup_num_steps': 1000,
        'warmup_type': 'log'
    }
    assert lr_schedules.get_lr_from_config(config) == (0.5, '')
    assert lr_schedules.get_config_from_args(parser.parse_args([]))[0] is None
