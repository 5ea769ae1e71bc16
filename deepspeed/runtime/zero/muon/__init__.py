# SPDX-License-Identifier: Apache-2.0
"""Upstream's module path of the Muon optimizer (``deepspeed.runtime.zero.muon.muon_optimizer``)."""
