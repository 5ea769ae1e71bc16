# SPDX-License-Identifier: Apache-2.0
"""What one rank did during one pool call, and the error that reports a failed call.

A call ends, for every rank, in exactly one `RankOutcome`: it returned (`OK`), its function raised (`RAISED`), its
process died (`DIED`) or it did not answer in time (`NO_REPLY`). `DistributedTestError` carries the outcomes of all
ranks so that a failing test shows the whole picture, not only the first rank that broke.
"""

import enum
from dataclasses import dataclass, field
from typing import Any, List, Optional

OUTPUT_TAIL_CHARS = 2000


class Status(enum.Enum):
    OK = "ok"
    RAISED = "raised"
    DIED = "died"
    NO_REPLY = "no reply"


@dataclass
class RankOutcome:
    """The end of one call on one rank.

    `value` is set only for OK; `summary` is one line (the exception, the exit code, why no reply came); `detail` holds
    the traceback of RAISED; `output` is the tail of what the rank wrote to stdout/stderr during the call (filled in
    by the pool on failure only; for a rank without a reply it ends with a dump of its Python stacks).
    """
    rank: int
    status: Status
    value: Any = None
    summary: str = ""
    detail: str = ""
    output: str = field(default="", repr=False)

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    def headline(self) -> str:
        text = f"rank {self.rank}: {self.status.value}"
        if self.summary:
            text += f" ({self.summary})"
        return text


class DistributedTestError(AssertionError):
    """A multi-rank call failed on at least one rank; the message holds every rank's outcome.

    `outcomes` is the list of `RankOutcome`, index = rank.
    """

    def __init__(self, message: str, outcomes: Optional[List[RankOutcome]] = None):
        super().__init__(message)
        self.outcomes = list(outcomes or [])


def tail(text: str, limit: int = OUTPUT_TAIL_CHARS) -> str:
    """The last `limit` characters of `text`, marked as cut when something was dropped."""
    if len(text) <= limit:
        return text
    return "[... output cut ...]\n" + text[-limit:]


def format_report(title: str, outcomes: List[RankOutcome]) -> str:
    """Render a failed call: a title, one headline per rank, then each rank's traceback and output tail."""
    lines = [title]
    lines += ["  " + outcome.headline() for outcome in outcomes]
    for outcome in outcomes:
        if outcome.detail and outcome.status is not Status.OK:
            lines.append(f"---------- rank {outcome.rank} {outcome.status.value} ----------")
            lines.append(outcome.detail.rstrip())
        if outcome.output.strip():
            lines.append(f"---------- rank {outcome.rank} output (last {OUTPUT_TAIL_CHARS} chars) ----------")
            lines.append(tail(outcome.output).rstrip())
    return "\n".join(lines)
