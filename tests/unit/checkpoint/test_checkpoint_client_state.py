# SPDX-License-Identifier: Apache-2.0
"""``load_checkpoint`` returns upstream's client state: the file's entries it did not consume.

For the model-states file a rank read, upstream returns every entry except ``module``;
unless ``load_module_only``, also except the counters and world sizes it restored;
``lr_scheduler`` and ``optimizer`` when it loaded them; an engine without ZeRO partitions
(stage 0) that loaded optimizer states gets the file's ``optimizer`` entry back. The
expected dict is computed here from the file itself (``upstream_client_state``), for
each load option, for stage 0, 2 and 3 engines and across stages; on stage 3 every rank
reads its own file and gets its own client state.
"""

import os

import pytest

from tests.unit.checkpoint import test_checkpoint_resume as common
from tests.unit.common import run_distributed

OPTIONS = [
    dict(),
    dict(load_module_only=True),
    dict(load_optimizer_states=False),
    dict(load_lr_scheduler_states=False),
    dict(load_optimizer_states=False, load_lr_scheduler_states=False),
]


def client_state_worker(tmp, save_stage, load_stage):
    import deepspeed.comm as dist
    common.attach_checkpointing()
    rank = dist.get_rank()
    saver = common.build_engine(common.make_config(save_stage, "bf16"), seed=0)
    common.train(saver, 2, 0, rank)
    saver.save_checkpoint(tmp, client_state={"epoch": 2, "rank": rank, "note": [1, 2]})
    saver.destroy()
    for options in OPTIONS:
        engine = common.build_engine(common.make_config(load_stage, "bf16"), seed=1)
        path, client_state = engine.load_checkpoint(tmp, **options)
        engine.destroy()
        expected = common.upstream_client_state(path, load_stage, **options)
        assert common.same_content(client_state, expected), (options, sorted(client_state), sorted(expected))
        assert client_state["epoch"] == 2 and client_state["note"] == [1, 2], client_state
        own = rank if save_stage == 3 else 0  # stage 3: every rank's own model-states file
        assert client_state["rank"] == own, (client_state["rank"], own)
        assert os.path.basename(path) == (f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
                                          if save_stage == 3 else "mp_rank_00_model_states.pt")
        stage0_gets_optimizer = load_stage == 0 and options.get("load_optimizer_states",
                                                                True) and not options.get("load_module_only", False)
        assert ("optimizer" in client_state) == (stage0_gets_optimizer
                                                 or not options.get("load_optimizer_states", True)), options
        assert ("global_steps" in client_state) == options.get("load_module_only", False), options
    return True


@pytest.mark.parametrize("save_stage,load_stage", [(0, 0), (2, 2), (3, 3), (0, 3), (3, 0)])
def test_client_state_is_upstreams(tmp_path, save_stage, load_stage):
    results = run_distributed(client_state_worker, 2, args=(str(tmp_path), save_stage, load_stage), timeout=90)
    assert results == [True] * 2
