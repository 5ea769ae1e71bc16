# SPDX-License-Identifier: Apache-2.0
"""Process launching: the ``deepspeed`` command (``deepspeed.launcher.runner``) built on torchrun."""
