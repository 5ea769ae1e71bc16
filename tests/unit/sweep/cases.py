# SPDX-License-Identifier: Apache-2.0
"""The random sweep's cases: what one case is, how a seed draws it, and its name.

A case is a plain dict (it travels to the worker processes and is written into the test id):

==================  ==========================================================================================
key                 meaning
==================  ==========================================================================================
``widths``          the MLP's layer widths (``Linear(widths[i], widths[i+1])``, tanh between), 1-wide layers
                    included, so biases and weights may have fewer elements than there are ranks
``world``           data-parallel ranks, 1 to 4
``stage``           ZeRO stage 0 to 3
``gas``             gradient accumulation steps, 1 to 3
``dtype``           "fp32", "bf16" or "fp16"
``clip``            ``gradient_clipping`` (0: off; a small value clips every step)
``bucket``          ``reduce_bucket_size`` (1: a bucket per parameter piece; 5e8: one bucket)
``overlap``         ``overlap_comm``
``offload``         ``offload_optimizer: cpu`` (stages 1-3); on stage 3 ``offload_param`` too when
                    ``offload_param`` is set
``units``           stage 3: (``stage3_prefetch_bucket_size``, ``stage3_param_persistence_threshold``)
``call``            how each micro-step calls backward: "engine" (``engine.backward(loss)``), "direct"
                    (``loss.backward()``; ``engine.scale(loss).backward()`` under fp16) or "two_losses"
                    (two ``engine.backward`` calls over one retained graph)
``compile``         None, or "torch" (``torch.compile(model)`` before ``initialize``, the "eager" backend:
                    dynamo's graphs and graph breaks around the hooks, without inductor's compile time)
``zenflow``         None, or the ``zenflow`` section (stages 1-2, optimizer offload, fp32, Adam; ``steps`` then
                    counts ZenFlow steps, one per micro-batch whatever ``gas``; stage 3: tests/unit/zenflow)
``steps``           optimizer steps
==================  ==========================================================================================

:func:`draw` makes one case from a :class:`random.Random`; a draw that upstream's rules or ours forbid is
adjusted, never rejected, so a seed always gives the same number of cases. :func:`case_id` names a case
compactly (the test id), :func:`cases` gives the cases of a seed.
"""

import random

WIDTHS = [1, 1, 2, 3, 4, 5, 7, 8, 13, 16]
BUCKETS = [1, 5, 16, 64, int(5e8)]
CLIPS = [0.0, 1.0, 0.05]
DEFAULT_SEED = 0
DEFAULT_CASES = 24


def draw(rng):
    """One case (see the module docstring)."""
    layers = rng.randint(1, 4)
    case = dict(
        widths=[rng.choice(WIDTHS) for _ in range(layers + 1)],
        world=rng.choice([1, 2, 2, 3, 3, 4]),
        stage=rng.randint(0, 3),
        gas=rng.randint(1, 3),
        dtype=rng.choices(["fp32", "bf16", "fp16"], weights=[5, 3, 2])[0],
        clip=rng.choice(CLIPS),
        bucket=rng.choice(BUCKETS),
        overlap=rng.random() < 0.5,
        offload=rng.random() < 0.3,
        offload_param=rng.random() < 0.5,
        units=(rng.choice([1, 20, int(5e7)]), rng.choice([0, 10, int(1e5)])),
        call=rng.choices(["engine", "direct", "two_losses"], weights=[3, 2, 2])[0],
        compile="torch" if rng.random() < 0.1 else None,
        zenflow=None,
        steps=rng.randint(2, 3),
    )
    if case["stage"] == 0:
        case["offload"] = False
    if case["stage"] != 3:
        case["offload_param"] = False
        case["units"] = None
    elif not case["offload"]:
        case["offload_param"] = False
    if case["stage"] in (1, 2) and rng.random() < 0.3:
        case["zenflow"] = dict(topk_ratio=rng.choice([0.1, 0.3, 0.5, 1.0]),
                               update_interval=rng.randint(1, 3),
                               select_strategy="step",
                               overlap_step=rng.random() < 0.5)
        case["zenflow"]["select_interval"] = case["zenflow"]["update_interval"] * rng.randint(1, 2)
        case.update(offload=True, dtype="fp32", call="engine", steps=rng.randint(4, 6))
    return case


def cases(seed, count):
    """The ``count`` cases of ``seed``: case ``i`` depends on ``(seed, i)`` only, so it can be rerun alone."""
    return [draw(random.Random(f"ds-sweep-{seed}-{i}")) for i in range(count)]


def case_id(case):
    """A compact name: ``z2-w3-gas2-fp32-8x1x3-b16-clip1-ovl-off-direct``."""
    parts = [
        f"z{case['stage']}", f"w{case['world']}", f"gas{case['gas']}", case["dtype"],
        "x".join(str(w) for w in case["widths"]), f"b{case['bucket']}", f"clip{case['clip']:g}"
    ]
    if case["overlap"]:
        parts.append("ovl")
    if case["offload"]:
        parts.append("offp" if case["offload_param"] else "off")
    if case["units"] is not None:
        parts.append(f"u{case['units'][0]}p{case['units'][1]}")
    parts.append(case["call"])
    if case["compile"]:
        parts.append("compiled")
    if case["zenflow"]:
        zf = case["zenflow"]
        parts.append(f"zf{zf['topk_ratio']:g}u{zf['update_interval']}s{zf['select_interval']}"
                     f"{'o' if zf['overlap_step'] else ''}")
    parts.append(f"s{case['steps']}")
    return "-".join(parts)
