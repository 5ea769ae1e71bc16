# SPDX-License-Identifier: Apache-2.0
"""Training benchmarks (run from the repository root; see benchmarks/README.md)."""
