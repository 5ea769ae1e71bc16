# SPDX-License-Identifier: Apache-2.0
"""The text of a flops profile: a summary, the top modules per depth, and the module tree with its numbers."""

import math

_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))


def _scaled(value, units):
    if units is None:
        units = ""
        for scale, prefix in _PREFIXES:
            if abs(value) >= scale:
                units = prefix
                break
    scale = dict((p, s) for s, p in _PREFIXES).get(units, 1.0)
    return value / scale, units


def number_to_string(value, units=None, precision=2):
    """``1.5e9`` -> ``"1.5 G"``; ``units`` forces a prefix (``"G"``, ``"M"``, ...; ``""`` for none)."""
    scaled, units = _scaled(value, units)
    return f"{round(scaled, precision):g} {units}".rstrip()


def flops_to_string(flops, units=None, precision=2):
    scaled, units = _scaled(flops, units)
    return f"{round(scaled, precision):g} {units}FLOPS"


def macs_to_string(macs, units=None, precision=2):
    scaled, units = _scaled(macs, units)
    return f"{round(scaled, precision):g} {units}MACs"


def params_to_string(params, units=None, precision=2):
    return number_to_string(params, units, precision)


def duration_to_string(seconds, precision=2):
    if seconds is None or math.isnan(seconds):
        return "-"
    if seconds >= 1.0:
        return f"{round(seconds, precision):g} s"
    if seconds >= 1e-3:
        return f"{round(seconds * 1e3, precision):g} ms"
    return f"{round(seconds * 1e6, precision):g} us"


def _ratio(part, whole):
    return f"{100.0 * part / whole:.2f}%" if whole else "0.00%"


def _rate(flops, seconds):
    return flops_to_string(flops / seconds) if seconds else "-"


def summary_lines(profile):
    """The summary block of ``profile`` (the dict :meth:`FlopsProfiler.profile_summary` returns)."""
    lines = [f"Profile Summary at step {profile['step']}:"]
    rows = [
        ("world size", profile.get("world_size")),
        ("data parallel size", profile.get("dp_world_size")),
        ("batch size per GPU", profile.get("micro_batch_size")),
        ("profiled forward passes", profile["forward_calls"]),
        ("params per GPU", params_to_string(profile["params"])),
        ("fwd MACs per GPU", macs_to_string(profile["fwd_macs"])),
        ("fwd flops per GPU", number_to_string(profile["fwd_flops"])),
        ("fwd latency", duration_to_string(profile["fwd_latency_s"])),
        ("fwd FLOPS per GPU = fwd flops per GPU / fwd latency", _rate(profile["fwd_flops"], profile["fwd_latency_s"])),
    ]
    if profile.get("iter_latency_s") is not None:
        factor = 2.0 + profile["recompute_fwd_factor"]
        rows += [
            (f"bwd flops per GPU = {factor:g} * fwd flops per GPU", number_to_string(profile["bwd_flops"])),
            ("bwd latency", duration_to_string(profile["bwd_latency_s"])),
            ("bwd FLOPS per GPU = bwd flops per GPU / bwd latency",
             _rate(profile["bwd_flops"], profile["bwd_latency_s"])),
            ("fwd+bwd flops per GPU", number_to_string(profile["fwd_flops"] + profile["bwd_flops"])),
            ("step latency", duration_to_string(profile["step_latency_s"])),
            ("iter latency", duration_to_string(profile["iter_latency_s"])),
            ("FLOPS per GPU = fwd+bwd flops per GPU / iter latency", flops_to_string(profile["flops_per_s"])),
            ("achieved TFLOP/s per GPU", f"{profile['flops_per_s'] / 1e12:.4g}"),
        ]
        if profile.get("samples_per_s") is not None:
            rows.append(("samples/second per GPU", f"{profile['samples_per_s']:.2f}"))
    width = max(len(label) for label, _ in rows) + 2
    lines += [f"{label + ':':<{width}}{value}" for label, value in rows if value is not None]
    return lines


def aggregated_lines(records, module_depth, top_modules):
    """Top ``top_modules`` modules by params, MACs and latency at each depth (to ``module_depth``; -1: all)."""
    by_depth = {}
    for record in records.values():
        by_depth.setdefault(record.depth, {})
        merged = by_depth[record.depth].setdefault(record.module_type, [0, 0, 0.0])
        merged[0] += record.params
        merged[1] += record.macs
        merged[2] += record.latency_s
    depths = sorted(by_depth) if module_depth < 0 else [d for d in sorted(by_depth) if d <= module_depth]
    lines = [f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
    for depth in depths:
        types = by_depth[depth]

        def top(index, fmt):
            ranked = sorted(types.items(), key=lambda item: item[1][index], reverse=True)[:top_modules]
            return "{" + ", ".join(f"'{name}': '{fmt(values[index])}'" for name, values in ranked) + "}"

        lines += [
            f"depth {depth}:",
            f"    params      - {top(0, params_to_string)}",
            f"    MACs        - {top(1, macs_to_string)}",
            f"    fwd latency - {top(2, duration_to_string)}",
        ]
    return lines


def detailed_lines(model, records, module_depth):
    """The module tree, each module annotated with its params, MACs, latency and FLOPS and their shares."""
    root = records.get("")
    total_params = root.params if root else 0
    total_macs = root.macs if root else 0
    total_latency = root.latency_s if root else 0.0
    lines = [
        "Each module's profile: params, percentage of total params, MACs, percentage of total MACs, fwd latency, "
        "percentage of total fwd latency, fwd FLOPS"
    ]

    def annotate(name):
        record = records.get(name)
        if record is None:
            return ""
        return (f"{params_to_string(record.params)}, {_ratio(record.params, total_params)} Params, "
                f"{macs_to_string(record.macs)}, {_ratio(record.macs, total_macs)} MACs, "
                f"{duration_to_string(record.latency_s)}, {_ratio(record.latency_s, total_latency)} latency, "
                f"{_rate(record.flops, record.latency_s)}")

    def walk(module, name, label, depth, indent):
        children = list(module.named_children())
        extra = module.extra_repr()
        head = f"{indent}{label}{type(module).__name__}({annotate(name)}"
        if extra and not children:
            lines.append(f"{head}, {extra})")
            return
        if not children or (0 <= module_depth <= depth):
            lines.append(head + ")")
            return
        lines.append(head)
        for child_name, child in children:
            walk(child, f"{name}.{child_name}" if name else child_name, f"({child_name}): ", depth + 1, indent + "  ")
        lines.append(f"{indent})")

    walk(model, "", "", 0, "")
    return lines


def render(profile, records, model, module_depth, top_modules, detailed):
    rule = "-" * 26
    lines = [f"\n{rule} DeepSpeed Flops Profiler {rule}"]
    lines += summary_lines(profile)
    lines += ["", f"{rule} Aggregated Profile per GPU {rule}"]
    lines += aggregated_lines(records, module_depth, top_modules)
    if detailed:
        lines += ["", f"{rule} Detailed Profile per GPU {rule}"]
        lines += detailed_lines(model, records, module_depth)
    lines.append("-" * (len(rule) * 2 + 26))
    return "\n".join(lines)
