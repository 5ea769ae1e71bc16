# SPDX-License-Identifier: Apache-2.0
"""``FusedLamb``: upstream's name, kept so imports resolve; constructing it raises NotImplementedError.

LAMB is not implemented here (see docs/compatibility.md). The class is a
``torch.optim.Optimizer`` subclass so that ``isinstance`` checks against it stay valid.
"""

import torch

__all__ = ['FusedLamb']


class FusedLamb(torch.optim.Optimizer):
    """Placeholder for upstream's FusedLamb; every construction raises NotImplementedError."""

    def __init__(self,
                 params,
                 lr=1e-3,
                 bias_correction=True,
                 betas=(0.9, 0.999),
                 eps=1e-8,
                 eps_inside_sqrt=False,
                 weight_decay=0.,
                 max_grad_norm=0.,
                 max_coeff=10.0,
                 min_coeff=0.01,
                 amsgrad=False):
        raise NotImplementedError('FusedLamb (optimizer type "Lamb") is not implemented; it is listed as unsupported '
                                  'in docs/compatibility.md. Use "Adam"/"AdamW" or pass your own optimizer instance.')
