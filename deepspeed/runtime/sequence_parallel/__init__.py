# SPDX-License-Identifier: Apache-2.0
"""Ulysses sequence parallelism for HF Transformers models and the ALST memory tools (see ``ulysses_sp``)."""
