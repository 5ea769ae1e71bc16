# SPDX-License-Identifier: Apache-2.0
"""The comms logger: per collective, its count, message size, latency and algorithmic / bus bandwidth.

``deepspeed.comm`` times a collective only while the logger is enabled and the collective is selected (``prof_all``,
or its name in ``prof_ops``); then it synchronises the device before and after the call and waits for an
asynchronous collective's completion, so profiling serialises communication with computation. Off, a collective
pays one attribute test.

Records are kept per name and message size, as upstream keeps them:
``comms_dict[name][msg_size_bytes] = [count, [latency_ms, ...], [algbw_gbps, ...], [busbw_gbps, ...]]``.

Message size is what this rank sends: the tensor of an all-reduce or broadcast, the per-rank input of an all-gather,
the full input of a reduce-scatter. Bandwidths follow the nccl-tests conventions, for ``n`` ranks and size ``S`` in
time ``t``: all-reduce algbw ``2S/t``, busbw ``2S(n-1)/(n t)``; all-gather algbw ``nS/t``, busbw ``algbw (n-1)/n``;
reduce-scatter and all-to-all algbw ``S/t``, busbw ``algbw (n-1)/n``; point-to-point, broadcast, reduce, gather,
scatter and barrier algbw = busbw = ``S/t``. Reported in Gbit/s; latencies in milliseconds.
"""

import datetime
import math
import sys

from deepspeed.utils.logging import log_dist

ALL_REDUCE_OPS = ("all_reduce", "all_reduce_coalesced", "inference_all_reduce")
ALL_GATHER_OPS = ("all_gather", "all_gather_into_tensor", "allgather_fn")
SCATTERING_OPS = ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_fn", "all_to_all", "all_to_all_single")
DIRECT_OPS = ("send", "recv", "isend", "irecv", "broadcast", "broadcast_object_list", "reduce", "gather", "scatter",
              "barrier", "monitored_barrier")


def _world():
    """``(world_size, rank)`` of the default process group, ``(1, 0)`` without one. Read from torch.distributed
    directly: ``deepspeed.comm`` imports this module, so this module does not import it back."""
    import torch.distributed as torch_dist
    if torch_dist.is_available() and torch_dist.is_initialized():
        return torch_dist.get_world_size(), torch_dist.get_rank()
    return 1, 0


def convert_size(size_bytes):
    """``1536`` -> ``"1.5 KB"`` (powers of 1024)."""
    if size_bytes <= 0:
        return "0B"
    units = ("B", "KB", "MB", "GB", "TB", "PB")
    exponent = min(int(math.floor(math.log(size_bytes, 1024))), len(units) - 1)
    return f"{round(size_bytes / 1024**exponent, 2)} {units[exponent]}"


def calc_bw_log(comm_op, size, duration, world_size=None):
    """``(algbw, busbw)`` in Gbit/s of ``comm_op`` moving ``size`` bytes in ``duration`` ms (module docstring)."""
    if world_size is None:
        world_size = _world()[0]
    n = max(int(world_size), 1)
    if duration <= 0:
        return 0.0, 0.0
    rate = size / duration  # bytes per ms
    if comm_op in ALL_REDUCE_OPS:
        algbw, busbw = 2 * rate, rate * 2 * (n - 1) / n
    elif comm_op in ALL_GATHER_OPS:
        algbw = rate * n
        busbw = algbw * (n - 1) / n
    elif comm_op in SCATTERING_OPS:
        algbw, busbw = rate, rate * (n - 1) / n
    elif comm_op in DIRECT_OPS:
        algbw = busbw = rate
    else:
        raise ValueError(f"the comms logger has no bandwidth rule for collective {comm_op!r}")
    # bytes/ms -> bits/s -> Gbit/s
    return algbw * 8 * 1e3 / 1e9, busbw * 8 * 1e3 / 1e9


def trim_mean(values, fraction=0.1):
    """Mean of ``values`` without the lowest and highest ``round(n * fraction)`` of them (upstream's count; all of
    them when that would leave none); 0 for no values. ``values`` is not modified (``deepspeed.utils.timer``
    exports it under upstream's name)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"trim_mean: the fraction to trim must be in [0, 1], got {fraction}")
    if not values:
        return 0.0
    ordered = sorted(values)
    cut = int(round(len(ordered) * fraction))
    kept = ordered[cut:len(ordered) - cut] or ordered
    return sum(kept) / len(kept)


def caller_name(depth):
    """The function name ``depth`` frames above the caller."""
    try:
        return sys._getframe(depth + 1).f_code.co_name
    except ValueError:
        return "<unknown>"


def get_caller_func(frame=3):
    """The name of the function ``frame`` frames up from this one (upstream's helper for naming collectives)."""
    return sys._getframe(frame).f_code.co_name


class CommsLogger:
    """The records of one process (see the module docstring); configured by ``deepspeed.comm.configure``."""

    def __init__(self):
        self.comms_dict = {}
        self.enabled = False
        self.verbose = False
        self.debug = False
        self.prof_all = True
        self.prof_ops = []

    def configure(self, comms_config):
        """Take ``comms_config.comms_logger_enabled`` and ``comms_config.comms_logger`` (upstream's shape)."""
        self.enabled = bool(comms_config.comms_logger_enabled)
        if self.enabled:
            section = comms_config.comms_logger
            self.verbose = section.verbose
            self.debug = section.debug
            self.prof_all = section.prof_all
            self.prof_ops = list(section.prof_ops)

    # Profiling can be narrowed at run time: everything, or a list of collectives by name.
    def start_profiling_comms(self):
        self.prof_all = True

    def stop_profiling_comms(self):
        self.prof_all = False

    def start_profiling_op(self, op_name_list):
        self.prof_ops = sorted(set(self.prof_ops) | set(op_name_list))

    def stop_profiling_op(self, op_name_list):
        self.prof_ops = [op for op in self.prof_ops if op not in op_name_list]

    def selects(self, op_name):
        """Whether a call of ``op_name`` is to be timed now."""
        return self.enabled and (self.prof_all or op_name in self.prof_ops)

    def append(self, raw_name, record_name, latency, msg_size):
        """Record one completed collective: ``latency`` in ms, ``msg_size`` in bytes."""
        algbw, busbw = calc_bw_log(raw_name, msg_size, latency)
        by_size = self.comms_dict.setdefault(record_name, {})
        record = by_size.get(msg_size)
        if record is None:
            by_size[msg_size] = [1, [latency], [algbw], [busbw]]
        else:
            record[0] += 1
            record[1].append(latency)
            record[2].append(algbw)
            record[3].append(busbw)
        if self.verbose:
            log_dist(
                f"comm op: {record_name} | time (ms): {latency:.2f} | msg size: {convert_size(msg_size)} | "
                f"algbw (Gbps): {algbw:.2f} | busbw (Gbps): {busbw:.2f}",
                ranks=[0])

    def get_raw_data(self):
        return {name: dict(by_size) for name, by_size in self.comms_dict.items()}

    def has_data(self):
        return bool(self.comms_dict)

    def reset_data(self):
        self.comms_dict.clear()

    def get_operation_names(self):
        return list(self.comms_dict)

    def get_total_operations(self):
        return sum(record[0] for by_size in self.comms_dict.values() for record in by_size.values())

    def get_operation_summary(self, operation_name):
        """``{msg_size: {count, total_latency_ms, avg_latency_ms, tput_avg_gbps, busbw_avg_gbps, ...}}`` or None."""
        by_size = self.comms_dict.get(operation_name)
        if by_size is None:
            return None
        return {size: _summary(size, record) for size, record in sorted(by_size.items())}

    def log_all(self, print_log=True, show_straggler=False, return_dict=False):
        """Print (``print_log``) and/or return (``return_dict``) the summary of every record.

        ``show_straggler`` adds, per record, the latency of the fastest rank and the time this rank waited beyond
        it; that is a collective (one all-reduce per record): every rank must call it with the same records.
        """
        summary = {name: self.get_operation_summary(name) for name in list(self.comms_dict)}
        stragglers = self._straggler_analysis(summary) if show_straggler else None
        if print_log:
            print(_render(summary, stragglers))
        if not return_dict:
            return None
        world_size, rank = _world()
        return {
            "summary": summary,
            "straggler_analysis": stragglers,
            "metadata": {
                "world_size": world_size,
                "rank": rank,
                "timestamp": datetime.datetime.now().isoformat(),
            },
        }

    def _straggler_analysis(self, summary):
        import torch
        import torch.distributed as torch_dist

        from deepspeed.accelerator import get_accelerator
        device = get_accelerator().current_device_name()
        result = {}
        for name in summary:
            result[name] = {}
            for size, record in sorted(self.comms_dict[name].items()):
                latencies = torch.tensor(record[1], dtype=torch.float64, device=device)
                fastest = latencies.clone()
                # torch.distributed directly: this reduction is not itself a record
                if torch_dist.is_initialized() and torch_dist.get_world_size() > 1:
                    torch_dist.all_reduce(fastest, op=torch_dist.ReduceOp.MIN)
                waited = (latencies - fastest).tolist()
                result[name][size] = {
                    "count": record[0],
                    "total_comm_lat_ms": float(fastest.sum()),
                    "total_straggler_ms": float(sum(waited)),
                    "avg_comm_lat_ms": trim_mean(fastest.tolist()),
                    "avg_straggler_ms": trim_mean(waited),
                    "msg_size_bytes": size,
                    "msg_size_str": convert_size(size),
                }
        return result


def _summary(size, record):
    count, latencies, algbws, busbws = record
    return {
        "count": count,
        "total_latency_ms": sum(latencies),
        "avg_latency_ms": trim_mean(latencies),
        "tput_avg_gbps": trim_mean(algbws),
        "busbw_avg_gbps": trim_mean(busbws),
        "msg_size_bytes": size,
        "msg_size_str": convert_size(size),
    }


def _render(summary, stragglers):
    columns = ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)",
               "busbw_avg (Gbps)")
    lines = ["".join(f"{c: <20}" for c in columns)]
    for name, by_size in summary.items():
        lines.append(name)
        for size, s in by_size.items():
            lines.append(f"{'': <20}{s['msg_size_str']: <20}{s['count']: <20}{s['total_latency_ms']: <20.2f}"
                         f"{s['avg_latency_ms']: <20.2f}{s['tput_avg_gbps']: <20.2f}{s['busbw_avg_gbps']: <20.2f}")
    if stragglers is not None:
        lines += ["_" * 31, "Breakdown with straggler effect", "-" * 31]
        columns = ("Comm. Op", "Message Size", "Count", "Total comm lat(ms)", "Total straggler(ms)",
                   "Avg comm lat(ms)", "Avg straggler(ms)")
        lines.append("".join(f"{c: <20}" for c in columns))
        for name, by_size in stragglers.items():
            lines.append(name)
            for size, s in by_size.items():
                lines.append(f"{'': <20}{s['msg_size_str']: <20}{s['count']: <20}{s['total_comm_lat_ms']: <20.2f}"
                             f"{s['total_straggler_ms']: <20.2f}{s['avg_comm_lat_ms']: <20.2f}"
                             f"{s['avg_straggler_ms']: <20.2f}")
    return "\n".join(lines)
