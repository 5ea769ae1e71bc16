# SPDX-License-Identifier: Apache-2.0
"""Upstream's module of ZenFlow helpers, by its name: how the cores are split between training and the host step."""

import math


def _split_affinity(cores, pt_reserved_cores_perc):
    """``(zenflow_cores, training_cores)`` from a list of cores: the first ``ceil(pt_reserved_cores_perc * n)``
    go to training and the rest to ZenFlow's host step; where that reserves none or all of them, both sides share
    every core (as upstream splits them)."""
    cores = list(cores)
    reserved = math.ceil(float(pt_reserved_cores_perc) * len(cores))
    if 0 < reserved < len(cores):
        return cores[reserved:], cores[:reserved]
    return cores, cores
