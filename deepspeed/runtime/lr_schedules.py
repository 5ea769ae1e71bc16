# SPDX-License-Identifier: Apache-2.0
"""Learning-rate schedules selected by the ``scheduler`` section of the config.

Five schedules, with upstream's names, constructor signatures, defaults and maths:
:class:`LRRangeTest`, :class:`OneCycle`, :class:`WarmupLR`, :class:`WarmupDecayLR` and
:class:`WarmupCosineLR`. They are per-batch schedules: ``step()`` is called once per
optimizer step and writes the learning rate for that step into ``optimizer.param_groups``.

Contract shared by every schedule:

- It works on any object exposing ``param_groups`` (a list of dicts with an ``"lr"`` key):
  a ``torch.optim.Optimizer`` or the engine's wrapper optimizer, whose ``param_groups`` are
  the client optimizer's dicts. A tensor ``"lr"`` is updated in place.
- ``last_batch_iteration`` is the index of the last batch the schedule was stepped for;
  ``-1`` means "not started". Constructing with ``-1`` writes the step-0 learning rate
  into the optimizer; constructing with another value (resuming) leaves it untouched.
- ``step(i=None)`` sets ``last_batch_iteration`` to ``i`` (default: one more than before)
  and writes ``get_lr()`` into the optimizer. ``get_lr()`` has no side effects.
- ``get_last_lr()`` returns the learning rates last written (floats, one per group).
- ``state_dict()`` is ``{'last_batch_iteration': i}``, the layout upstream checkpoints hold;
  ``load_state_dict`` restores it and the next ``step()`` continues from there.

Also: :func:`get_lr_scheduler_from_config` (config section -> instance) and upstream's
command-line helpers (:func:`add_tuning_arguments`, :func:`get_config_from_args`,
:func:`get_lr_from_config`).
"""

import argparse
import logging
import math

import torch

logger = logging.getLogger(__name__)

LR_SCHEDULE = 'lr_schedule'
LR_RANGE_TEST = 'LRRangeTest'
ONE_CYCLE = 'OneCycle'
WARMUP_LR = 'WarmupLR'
WARMUP_DECAY_LR = 'WarmupDecayLR'
WARMUP_COSINE_LR = 'WarmupCosineLR'
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

LR_RANGE_TEST_MIN_LR = 'lr_range_test_min_lr'
LR_RANGE_TEST_STEP_RATE = 'lr_range_test_step_rate'
LR_RANGE_TEST_STEP_SIZE = 'lr_range_test_step_size'
LR_RANGE_TEST_STAIRCASE = 'lr_range_test_staircase'

EDGE_VALUE = 'edge_value'
MID_VALUE = 'mid_value'

CYCLE_FIRST_STEP_SIZE = 'cycle_first_step_size'
CYCLE_FIRST_STAIR_COUNT = 'cycle_first_stair_count'
CYCLE_SECOND_STEP_SIZE = 'cycle_second_step_size'
CYCLE_SECOND_STAIR_COUNT = 'cycle_second_stair_count'
DECAY_STEP_SIZE = 'decay_step_size'

CYCLE_MIN_LR = 'cycle_min_lr'
CYCLE_MAX_LR = 'cycle_max_lr'
DECAY_LR_RATE = 'decay_lr_rate'

CYCLE_MIN_MOM = 'cycle_min_mom'
CYCLE_MAX_MOM = 'cycle_max_mom'
DECAY_MOM_RATE = 'decay_mom_rate'

WARMUP_MIN_LR = 'warmup_min_lr'
WARMUP_MAX_LR = 'warmup_max_lr'
WARMUP_NUM_STEPS = 'warmup_num_steps'
WARMUP_TYPE = 'warmup_type'
WARMUP_LOG_RATE = 'log'
WARMUP_LINEAR_RATE = 'linear'

WARMUP_MIN_RATIO = 'warmup_min_ratio'
COS_MIN_RATIO = 'cos_min_ratio'

TOTAL_NUM_STEPS = 'total_num_steps'

# OneCycle cycles beta1 and pins beta2 to this value, as upstream does.
_ONE_CYCLE_BETA2 = 0.99

# ---------------------------------------------------------------------------------------------
# Helpers on param_groups
# ---------------------------------------------------------------------------------------------


def _param_groups_of(optimizer):
    """The ``param_groups`` list the schedule drives; raises TypeError if there is none."""
    groups = getattr(optimizer, 'param_groups', None)
    if not isinstance(groups, list):
        raise TypeError(f'{type(optimizer).__name__} has no param_groups list; an LR schedule needs an optimizer '
                        'exposing param_groups')
    return groups


def _per_group(value, groups, name):
    """Expand a scalar to one value per group; a list/tuple must already have one per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(groups):
            raise ValueError(f'expected {len(groups)} values for {name} (one per param group), got {len(value)}')
        return list(value)
    return [value] * len(groups)


def _as_float(lr):
    return float(lr.item()) if torch.is_tensor(lr) else float(lr)


def _write_lrs(groups, lrs):
    """Write ``lrs`` into ``groups`` (a tensor lr is filled in place); return them as floats."""
    written = []
    for group, lr in zip(groups, lrs):
        if torch.is_tensor(group['lr']):
            group['lr'].fill_(lr)
        else:
            group['lr'] = lr
        written.append(_as_float(lr))
    return written


def _check_warmup_num_steps(warmup_num_steps):
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ValueError(f'warmup_num_steps must be a positive integer, got {warmup_num_steps!r}')


def _check_warmup_type(warmup_type):
    if warmup_type in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        return warmup_type
    raise ValueError(f'warmup_type must be {WARMUP_LOG_RATE!r} or {WARMUP_LINEAR_RATE!r}, got {warmup_type!r}')


def _warmup_fraction(warmup_type, iteration, warmup_num_steps):
    """Progress through warmup in [0, 1) for ``0 <= iteration < warmup_num_steps``.

    log:    ln(iteration + 1) / ln(warmup_num_steps)
    linear: iteration / warmup_num_steps
    """
    if warmup_type == WARMUP_LOG_RATE:
        return math.log(iteration + 1) / math.log(warmup_num_steps)
    return iteration / warmup_num_steps


# ---------------------------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------------------------


class _BatchSchedule:
    """Shared bookkeeping: the iteration counter, writing lrs, get_last_lr and state_dict."""

    def __init__(self, optimizer, last_batch_iteration):
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = None

    def get_lr(self):
        """Learning rates for ``self.last_batch_iteration``, one per param group."""
        raise NotImplementedError

    def get_last_lr(self):
        """The learning rates last written into the optimizer."""
        # The message is part of the contract: HF Trainer looks for "need to call step".
        assert self._last_lr is not None, 'need to call step() first'
        return self._last_lr

    def _advance(self, iteration):
        if iteration is None:
            iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = iteration
        self._last_lr = _write_lrs(self.optimizer.param_groups, self.get_lr())

    def _start(self):
        """Write the step-0 learning rate when the schedule starts from the beginning."""
        if self.last_batch_iteration == -1:
            self._last_lr = _write_lrs(self.optimizer.param_groups, self.get_lr())

    def state_dict(self):
        return {'last_batch_iteration': self.last_batch_iteration}

    def load_state_dict(self, sd):
        self.last_batch_iteration = sd['last_batch_iteration']


class LRRangeTest(_BatchSchedule):
    """Learning-rate range test: grow the learning rate from ``lr_range_test_min_lr``.

    With ``i = last_batch_iteration + 1`` and ``interval = i / lr_range_test_step_size``
    (floored when ``lr_range_test_staircase``)::

        lr = lr_range_test_min_lr * (1 + lr_range_test_step_rate * interval)

    ``lr_range_test_min_lr`` may be a list with one value per param group.
    """

    def __init__(self,
                 optimizer,
                 lr_range_test_min_lr: float = 1e-3,
                 lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1):
        if isinstance(lr_range_test_step_size, bool) or not lr_range_test_step_size > 0:
            raise ValueError(f"LRRangeTest: lr_range_test_step_size must be positive (it divides the step), got "
                             f"{lr_range_test_step_size!r}")
        groups = _param_groups_of(optimizer)
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = _per_group(lr_range_test_min_lr, groups, LR_RANGE_TEST_MIN_LR)
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self._start()

    def _interval(self):
        interval = (self.last_batch_iteration + 1) / self.step_size
        return math.floor(interval) if self.staircase else interval

    def get_lr(self):
        growth = 1 + self.step_rate * self._interval()
        return [min_lr * growth for min_lr in self.min_lr]

    def step(self, batch_iteration=None):
        self._advance(batch_iteration)


class OneCycle(_BatchSchedule):
    """1Cycle policy: one triangular cycle of the learning rate (and momentum), then decay.

    Cycle shape, with ``i = last_batch_iteration + 1``, ``S1 = cycle_first_step_size``,
    ``S2 = cycle_second_step_size`` (default ``S1``) and ``x = frac(i / (S1 + S2))``::

        scale = x / r                  if x <= r,   r = S1 / (S1 + S2)   (rising half)
        scale = (1 - x) / (1 - r)      otherwise                        (falling half)
        lr    = cycle_min_lr + (cycle_max_lr - cycle_min_lr) * scale
        beta1 = cycle_max_mom - (cycle_max_mom - cycle_min_mom) * scale

    A positive stair count for a half quantises ``scale`` to ``floor(scale * n) / n``
    (computed from the integer position, so a stair boundary is exact).

    After the cycle (``last_batch_iteration >= S1 + S2``), with
    ``k = last_batch_iteration - (S1 + S2) + 1``::

        lr    = cycle_min_lr / (1 + decay_lr_rate * k / decay_step_size)
        beta1 = cycle_max_mom * (1 + decay_mom_rate * k / decay_step_size)

    where a zero ``decay_step_size`` or zero rate means no decay (``cycle_min_lr`` /
    ``cycle_max_mom``). Momentum is cycled through each group's ``betas`` (``beta2`` is set
    to 0.99, as upstream does); optimizers without ``betas`` are left alone, with a warning.
    Constructing with ``last_batch_iteration=-1`` sets ``lr = cycle_min_lr`` and
    ``beta1 = cycle_min_mom``.
    """

    def __init__(self,
                 optimizer,
                 cycle_min_lr,
                 cycle_max_lr,
                 decay_lr_rate=0.,
                 cycle_first_step_size=2000,
                 cycle_second_step_size=None,
                 cycle_first_stair_count=0,
                 cycle_second_stair_count=None,
                 decay_step_size=0,
                 cycle_momentum=True,
                 cycle_min_mom=0.8,
                 cycle_max_mom=0.9,
                 decay_mom_rate=0.,
                 last_batch_iteration=-1):
        groups = _param_groups_of(optimizer)
        super().__init__(optimizer, last_batch_iteration)

        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = (float(cycle_second_step_size)
                                 if cycle_second_step_size is not None else self.first_step_size)
        # A cycle needs a rising half: a zero or negative first half has no shape (and divides by zero below).
        if not self.first_step_size > 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {cycle_first_step_size}")
        if self.second_step_size < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {cycle_second_step_size}")
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (cycle_first_stair_count
                                   if cycle_second_stair_count is None else cycle_second_stair_count)
        self.decay_step_size = decay_step_size
        no_decay_interval = math.isclose(decay_step_size, 0)

        self.min_lrs = _per_group(cycle_min_lr, groups, CYCLE_MIN_LR)
        self.max_lrs = _per_group(cycle_max_lr, groups, CYCLE_MAX_LR)
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = no_decay_interval or math.isclose(decay_lr_rate, 0)

        self.cycle_momentum = cycle_momentum
        if cycle_momentum and not all('betas' in group for group in groups):
            logger.warning(f'cycle_momentum is disabled: {type(optimizer).__name__} has no betas in its param groups')
            self.cycle_momentum = False
        self.decay_mom_rate = decay_mom_rate
        self.skip_mom_decay = no_decay_interval or math.isclose(decay_mom_rate, 0)
        self.min_moms = _per_group(cycle_min_mom, groups, CYCLE_MIN_MOM)
        self.max_moms = _per_group(cycle_max_mom, groups, CYCLE_MAX_MOM)

        if last_batch_iteration == -1:
            self._last_lr = _write_lrs(groups, self.min_lrs)
            if self.cycle_momentum:
                for group, mom in zip(groups, self.min_moms):
                    group['betas'] = (mom, _ONE_CYCLE_BETA2)

    def _scale_factor(self):
        """Position in the cycle as a height in [0, 1] (see the class docstring)."""
        iteration = self.last_batch_iteration + 1
        x = iteration / self.total_size - math.floor(iteration / self.total_size)
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (1 - x) / (1 - self.step_ratio), self.second_stair_count
        if stairs > 0:
            # Quantise from the integer offset in the cycle: the float scale at a half-cycle end
            # can fall a hair below an exact stair, and flooring it would drop a whole stair.
            offset = iteration % self.total_size
            if offset <= self.first_step_size:
                position = offset * stairs / self.first_step_size
            else:
                position = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _in_cycle(self):
        return self.last_batch_iteration < self.total_size

    def _decay_interval(self):
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self):
        if self._in_cycle():
            scale = self._scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        return [lo / (1 + self.decay_lr_rate * self._decay_interval()) for lo in self.min_lrs]

    def get_mom(self):
        """``betas`` tuples for ``self.last_batch_iteration``; None when momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        if self._in_cycle():
            scale = self._scale_factor()
            beta1s = [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        elif self.skip_mom_decay:
            beta1s = list(self.max_moms)
        else:
            beta1s = [hi * (1 + self.decay_mom_rate * self._decay_interval()) for hi in self.max_moms]
        return [(beta1, _ONE_CYCLE_BETA2) for beta1 in beta1s]

    def step(self, batch_iteration=None):
        self._advance(batch_iteration)
        if self.cycle_momentum:
            for group, betas in zip(self.optimizer.param_groups, self.get_mom()):
                group['betas'] = betas


class WarmupLR(_BatchSchedule):
    """Warm the learning rate up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold it.

    With ``t = last_batch_iteration`` and ``W = max(2, warmup_num_steps)``::

        gamma = ln(t + 1) / ln(W)   (warmup_type 'log')    for t < W
        gamma = t / W               (warmup_type 'linear') for t < W
        gamma = 1                                           for t >= W
        lr    = warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma

    ``warmup_max_lr=None`` takes each param group's current learning rate. Both bounds
    may be lists with one value per param group. Before the first step (``t < 0``) the
    learning rate is ``warmup_min_lr``.
    """

    def __init__(self,
                 optimizer,
                 warmup_min_lr: float = 0.0,
                 warmup_max_lr: float = None,
                 warmup_num_steps: int = 1000,
                 warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1):
        _check_warmup_num_steps(warmup_num_steps)
        groups = _param_groups_of(optimizer)
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:  # each group's own learning rate, as upstream
            warmup_max_lr = [_as_float(group['lr']) for group in groups]
        self.min_lrs = _per_group(warmup_min_lr, groups, WARMUP_MIN_LR)
        self.max_lrs = _per_group(warmup_max_lr, groups, WARMUP_MAX_LR)
        self.delta_lrs = [hi - lo for lo, hi in zip(self.min_lrs, self.max_lrs)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _check_warmup_type(warmup_type)
        self._start()

    def _get_gamma(self):
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(self.warmup_type, self.last_batch_iteration, self.warmup_num_steps)
        return 1.0

    def get_lr(self):
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._get_gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]

    def step(self, last_batch_iteration=None):
        self._advance(last_batch_iteration)


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`, then a linear decay to zero at ``total_num_steps``.

    After warmup (``t >= W``), with ``T = total_num_steps``::

        gamma = max(0, (T - t) / max(1, T - W))
    """

    def __init__(self,
                 optimizer,
                 total_num_steps: int,
                 warmup_min_lr: float = 0.0,
                 warmup_max_lr: float = 0.001,
                 warmup_num_steps: int = 1000,
                 warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(f'total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}')

    def _get_gamma(self):
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(self.warmup_type, self.last_batch_iteration, self.warmup_num_steps)
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_BatchSchedule):
    """Warm up as a ratio of each group's initial learning rate, then cosine-decay.

    The base learning rates are the groups' ``lr`` at construction. With
    ``t = last_batch_iteration``, ``W = max(2, warmup_num_steps)``, ``T = total_num_steps``::

        ratio = warmup_min_ratio + (1 - warmup_min_ratio) * f(t)              for 0 <= t < W
        p     = min(1, (t - W + 1) / max(1, T - W))                           for t >= W
        ratio = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2)
        lr    = base_lr * ratio

    where ``f`` is the warmup fraction of :class:`WarmupLR` (log or linear). Before the
    first step (``t < 0``) the ratio is 0.
    """

    def __init__(self,
                 optimizer,
                 total_num_steps: int,
                 warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000,
                 cos_min_ratio: float = 0.0001,
                 warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1):
        _check_warmup_num_steps(warmup_num_steps)
        groups = _param_groups_of(optimizer)
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _check_warmup_type(warmup_type)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(f'total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}')
        self.org_lrs = [_as_float(group['lr']) for group in groups]
        self._start()

    def get_lr_ratio(self):
        """The multiplier applied to each group's base learning rate at ``last_batch_iteration``."""
        t = self.last_batch_iteration
        if t < 0:
            return 0.0
        if t < self.warmup_num_steps:
            fraction = _warmup_fraction(self.warmup_type, t, self.warmup_num_steps)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * fraction
        # Clamped progress keeps the ratio at its floor past the end instead of rising again.
        progress = min(1.0, (t - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self):
        ratio = self.get_lr_ratio()
        return [base * ratio for base in self.org_lrs]

    def step(self, last_batch_iteration=None):
        self._advance(last_batch_iteration)


# ---------------------------------------------------------------------------------------------
# Construction from config
# ---------------------------------------------------------------------------------------------

_SCHEDULE_CLASSES = {
    LR_RANGE_TEST: LRRangeTest,
    ONE_CYCLE: OneCycle,
    WARMUP_LR: WarmupLR,
    WARMUP_DECAY_LR: WarmupDecayLR,
    WARMUP_COSINE_LR: WarmupCosineLR,
}


def _torch_scheduler_class(name):
    candidate = getattr(torch.optim.lr_scheduler, name, None)
    if isinstance(candidate, type) and issubclass(candidate, torch.optim.lr_scheduler.LRScheduler):
        return candidate
    return None


def get_lr_scheduler_from_config(optimizer, name, params):
    """Build the schedule named by the config's ``scheduler.type`` with ``scheduler.params``.

    ``name`` is one of :data:`VALID_LR_SCHEDULES`; like upstream, a class name from
    ``torch.optim.lr_scheduler`` (e.g. ``"StepLR"``) is also accepted and built on the
    underlying ``torch.optim.Optimizer`` (``optimizer`` itself or ``optimizer.optimizer``).
    Raises ValueError for any other name and for a parameter still set to ``"auto"``
    (a framework placeholder that should have been replaced before it reaches us).
    """
    params = dict(params or {})
    for key, value in params.items():
        if isinstance(value, str) and value == 'auto':
            raise ValueError(f'scheduler.params.{key} is "auto"; the launching framework must replace "auto" '
                             'with a value before the config reaches DeepSpeed')
    if name in _SCHEDULE_CLASSES:
        return _SCHEDULE_CLASSES[name](optimizer, **params)
    torch_class = _torch_scheduler_class(name) if isinstance(name, str) else None
    if torch_class is not None:
        torch_optimizer = optimizer
        if not isinstance(optimizer, torch.optim.Optimizer):
            torch_optimizer = getattr(optimizer, 'optimizer', None)
        if not isinstance(torch_optimizer, torch.optim.Optimizer):
            raise TypeError(f'torch scheduler {name} needs a torch.optim.Optimizer, got {type(optimizer).__name__}')
        return torch_class(torch_optimizer, **params)
    raise ValueError(f'Unknown LR scheduler {name!r}: expected one of {VALID_LR_SCHEDULES} '
                     'or a class name from torch.optim.lr_scheduler')


# ---------------------------------------------------------------------------------------------
# Command-line helpers
# ---------------------------------------------------------------------------------------------

# Which command-line keys belong to which schedule (WarmupDecayLR/WarmupCosineLR share WarmupLR's).
_RANGE_TEST_KEYS = (LR_RANGE_TEST_MIN_LR, LR_RANGE_TEST_STEP_RATE, LR_RANGE_TEST_STEP_SIZE, LR_RANGE_TEST_STAIRCASE)
_ONE_CYCLE_KEYS = (CYCLE_FIRST_STEP_SIZE, CYCLE_FIRST_STAIR_COUNT, CYCLE_SECOND_STEP_SIZE, CYCLE_SECOND_STAIR_COUNT,
                   DECAY_STEP_SIZE, CYCLE_MIN_LR, CYCLE_MAX_LR, DECAY_LR_RATE, CYCLE_MIN_MOM, CYCLE_MAX_MOM,
                   DECAY_MOM_RATE)
_WARMUP_KEYS = (WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS, WARMUP_TYPE)


def add_tuning_arguments(parser):
    """Add the LR-schedule command-line options (upstream's names and defaults) to ``parser``."""
    group = parser.add_argument_group('Convergence Tuning', 'Convergence tuning configurations')
    group.add_argument('--lr_schedule', type=str, default=None, help='LR schedule for training.')

    group.add_argument('--lr_range_test_min_lr', type=float, default=0.001, help='Starting lr value.')
    group.add_argument('--lr_range_test_step_rate', type=float, default=1.0, help='Scaling rate for LR range test.')
    group.add_argument('--lr_range_test_step_size', type=int, default=1000, help='Training steps per LR change.')
    group.add_argument('--lr_range_test_staircase',
                       type=bool,
                       default=False,
                       help='Use staircase scaling for LR range test.')

    group.add_argument('--cycle_first_step_size', type=int, default=1000, help='Size of first step of 1Cycle.')
    group.add_argument('--cycle_first_stair_count', type=int, default=-1, help='First stair count for 1Cycle.')
    group.add_argument('--cycle_second_step_size', type=int, default=-1, help='Size of second step of 1Cycle.')
    group.add_argument('--cycle_second_stair_count', type=int, default=-1, help='Second stair count for 1Cycle.')
    group.add_argument('--decay_step_size', type=int, default=1000, help='Interval of post-cycle decay.')
    group.add_argument('--cycle_min_lr', type=float, default=0.01, help='1Cycle LR lower bound.')
    group.add_argument('--cycle_max_lr', type=float, default=0.1, help='1Cycle LR upper bound.')
    group.add_argument('--decay_lr_rate', type=float, default=0.0, help='Post-cycle LR decay rate.')
    group.add_argument('--cycle_momentum', default=False, action='store_true', help='Enable 1Cycle momentum.')
    group.add_argument('--cycle_min_mom', type=float, default=0.8, help='1Cycle momentum lower bound.')
    group.add_argument('--cycle_max_mom', type=float, default=0.9, help='1Cycle momentum upper bound.')
    group.add_argument('--decay_mom_rate', type=float, default=0.0, help='Post-cycle momentum decay rate.')

    group.add_argument('--warmup_min_lr', type=float, default=0, help='WarmupLR minimum/initial LR value.')
    group.add_argument('--warmup_max_lr', type=float, default=0.001, help='WarmupLR maximum LR value.')
    group.add_argument('--warmup_num_steps', type=int, default=1000, help='WarmupLR step count for LR warmup.')
    group.add_argument('--warmup_type', type=str, default=WARMUP_LOG_RATE, help='WarmupLR increasing function.')

    group.add_argument('--warmup_min_ratio', type=float, default=0.01, help='Cosine LR warmup start ratio.')
    group.add_argument('--cos_min_ratio', type=float, default=0.01, help='Cosine LR lower bound.')
    return parser


def parse_arguments():
    """Parse the tuning options from ``sys.argv``; returns ``(args, unknown_args)``."""
    parser = add_tuning_arguments(argparse.ArgumentParser())
    return parser.parse_known_args()


def _copy_args(args, params, keys):
    for key in keys:
        value = getattr(args, key, None)
        if value is not None:
            params[key] = value


def override_params(args, params):
    """Copy every schedule option set (not None) on ``args`` into ``params``."""
    _copy_args(args, params, _RANGE_TEST_KEYS + _ONE_CYCLE_KEYS + _WARMUP_KEYS)


def get_config_from_args(args):
    """``({'type': ..., 'params': {...}}, None)`` from ``args.lr_schedule``, or ``(None, reason)``."""
    schedule = getattr(args, LR_SCHEDULE, None)
    if schedule is None:
        return None, f'--{LR_SCHEDULE} not specified on command line'
    if schedule not in VALID_LR_SCHEDULES:
        return None, f'{schedule} is not supported LR schedule'
    keys = {LR_RANGE_TEST: _RANGE_TEST_KEYS, ONE_CYCLE: _ONE_CYCLE_KEYS}.get(schedule, _WARMUP_KEYS)
    params = {}
    _copy_args(args, params, keys)
    return {'type': schedule, 'params': params}, None


def get_lr_from_config(config):
    """The headline learning rate of a scheduler config: ``(lr, '')`` or ``(None, reason)``."""
    if 'type' not in config:
        return None, 'LR schedule type not defined in config'
    if 'params' not in config:
        return None, 'LR schedule params not defined in config'
    schedule, params = config['type'], config['params']
    if schedule not in VALID_LR_SCHEDULES:
        return None, f'{schedule} is not a valid LR schedule'
    if schedule == LR_RANGE_TEST:
        return params[LR_RANGE_TEST_MIN_LR], ''
    if schedule == ONE_CYCLE:
        return params[CYCLE_MAX_LR], ''
    return params[WARMUP_MAX_LR], ''
