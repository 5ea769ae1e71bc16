# SPDX-License-Identifier: Apache-2.0
"""Upstream's ``deepspeed.runtime.comm``: coalesced collectives over lists of tensors."""
