# SPDX-License-Identifier: Apache-2.0
"""The data loader ``deepspeed.initialize(training_data=...)`` returns (one shard of the data per rank), and
``RepeatingLoader``, which restarts a loader when it ends."""

from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


class RepeatingLoader:
    """Iterate over ``loader`` forever: when it is exhausted, a new iterator over it starts (a new epoch)."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


class DeepSpeedDataLoader:
    """Iterates over this rank's shard of ``dataset`` in micro-batches, reshuffled per epoch."""

    def __init__(self,
                 dataset,
                 batch_size,
                 pin_memory=False,
                 collate_fn=None,
                 data_sampler=None,
                 num_local_io_workers=None,
                 dp_rank=0,
                 dp_world_size=1,
                 drop_last=False):
        if data_sampler is None:
            data_sampler = DistributedSampler(dataset, num_replicas=dp_world_size, rank=dp_rank)
        self.data_sampler = data_sampler
        self.epoch = 0
        self.batch_size = batch_size
        self.dataloader = DataLoader(dataset,
                                     batch_size=batch_size,
                                     sampler=data_sampler,
                                     collate_fn=collate_fn,
                                     pin_memory=pin_memory,
                                     num_workers=num_local_io_workers or 0,
                                     drop_last=drop_last)

    def __len__(self):
        return len(self.dataloader)

    def __iter__(self):
        if hasattr(self.data_sampler, "set_epoch"):
            self.data_sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.dataloader)
