# SPDX-License-Identifier: Apache-2.0
"""The backward path: one session per backward call owns scaling, routing and the epilogue."""

from deepspeed.runtime.backward.session import BackwardContractError, BackwardSession, Seed  # noqa: F401
