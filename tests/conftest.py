# SPDX-License-Identifier: Apache-2.0
"""Session-wide test setup: the multi-rank worker pools are closed when the pytest session finishes."""

from tests.unit.harness import shutdown_pools


def pytest_sessionfinish(session, exitstatus):
    shutdown_pools()
