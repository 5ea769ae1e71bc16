# SPDX-License-Identifier: Apache-2.0
"""Batch intake and batch results for ``PipelineEngine``: the data iterator the first and last stages draw
from, and the reduction of the last stage's losses and outputs to every stage (a failed batch discarded whole).
"""

from collections import OrderedDict

import torch

import deepspeed.comm as dist
from deepspeed.runtime.dataloader import RepeatingLoader

BATCH_INPUT_TIMER = "batch_input"
TRAIN_BATCH_TIMER = "train_batch"


class BatchMixin:
    """``PipelineEngine``'s data iterator and loss aggregation (state set up by the engine)."""

    def _build_data_iter(self, dataset):
        sampler = torch.utils.data.distributed.DistributedSampler(dataset,
                                                                  num_replicas=self.dp_world_size,
                                                                  rank=self.mpu.get_data_parallel_rank(),
                                                                  shuffle=False)
        self.set_dataloader(RepeatingLoader(self.deepspeed_io(dataset, data_sampler=sampler)))

    # ------------------------------------------------------------------ data
    def set_dataloader(self, loader):
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.data_iterator = iter(self.training_dataloader)

    def set_dataiterator(self, iterator):
        """Store an iterator to sample for training data (read by the first and last stages)."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = None
            self.data_iterator = iterator

    def set_batch_fn(self, fn):
        """A function applied to every batch drawn from the data iterator."""
        self.batch_fn = fn

    def _next_batch(self):
        batch = None
        if self.data_iterator is not None:
            batch = next(self.data_iterator)
        if self.batch_fn:
            batch = self.batch_fn(batch)
        return batch

    def _discard_batch(self):
        """A batch that raised leaves nothing behind: no half-accumulated window, no buffers, no queued transfer
        (the next ``train_batch`` starts clean on every stage, whichever stage failed where)."""
        self._exchange, self._in_group = None, False
        self._received_grads.clear()
        self._buffer_losses.clear()
        self._split_backwards.clear()
        for key in self.pipe_buffers:
            self.pipe_buffers[key] = [None] * len(self.pipe_buffers[key])
        self.window.boundary_flag = None
        self.zero_grad()

    def _scale_loss_by_gas(self, prescaled_loss, eval_micro_batches=None):
        gas = eval_micro_batches if eval_micro_batches is not None else self.micro_batches
        if isinstance(prescaled_loss, torch.Tensor):
            return prescaled_loss / gas
        if isinstance(prescaled_loss, (tuple, list)):
            return [loss / gas if isinstance(loss, torch.Tensor) else loss for loss in prescaled_loss]
        return prescaled_loss

    def _reduce_outputs(self, outputs, reduce="avg", reduce_dp=True, micro_batches=None):
        if reduce is None:
            return outputs
        if reduce.lower() != "avg":
            raise NotImplementedError(f"reduction type {reduce} not supported.")
        if torch.is_tensor(outputs[0]):
            reduced = sum(outputs)
        else:
            reduced = [sum(out[i] for out in outputs) for i in range(len(outputs[0]))]
        reduced = self._scale_loss_by_gas(reduced, eval_micro_batches=micro_batches)
        if reduce_dp and self.is_data_parallel:
            for tensor in ([reduced] if torch.is_tensor(reduced) else reduced):
                dist.all_reduce(tensor, group=self.mpu.get_data_parallel_group())
                tensor /= self.dp_world_size
        return reduced

    def _bcast_pipe_scalar(self, data, src_rank=None, dtype=torch.float32):
        src_rank = self._loss_stage_global_rank() if src_rank is None else src_rank
        if self.global_rank == src_rank:
            result = data.clone().detach().type(dtype).to(self.device)
        else:
            result = torch.tensor([0.0], dtype=dtype, device=self.device)
        if self.is_pipe_parallel:
            result = result.reshape(1) if result.dim() == 0 and self.global_rank != src_rank else result
            if self.global_rank == src_rank:
                result = result.reshape(1)
            dist.broadcast(tensor=result, src=src_rank, group=self.mpu.get_pipe_parallel_group())
            result = result.reshape(())
        return result

    def _aggregate_total_loss(self):
        """The batch's mean loss over micro-batches and data-parallel replicas, on every stage (from the last)."""
        if self.is_last_stage():
            loss = self._scale_loss_by_gas(self.total_loss)
            self.agg_additional_losses = self.total_additional_losses
            if self.agg_additional_losses is not None:
                self.agg_additional_losses = OrderedDict((name, self._scale_loss_by_gas(value.clone().detach()))
                                                         for name, value in self.agg_additional_losses.items())
            self.dp_group_loss = loss.clone().detach().float()
            tensors = [self.dp_group_loss.reshape(-1)]
            extra = list((self.agg_additional_losses or {}).values())
            tensors += [t.detach().float().reshape(-1) for t in extra]
            flat = torch.cat(tensors)
            if self.is_data_parallel:
                dist.all_reduce(flat, group=self.mpu.get_data_parallel_group())
                flat /= self.dp_world_size
            losses = torch.cat([self.dp_group_loss.reshape(-1), flat])
            if self.is_pipe_parallel:
                dist.broadcast(tensor=losses, src=self.global_rank, group=self.mpu.get_pipe_parallel_group())
        else:
            extra = self.module.get_additional_losses()
            count = 2 + (0 if extra is None else len(extra))
            losses = torch.zeros(count, device=self.device)
            dist.broadcast(tensor=losses,
                           src=self._loss_stage_global_rank(),
                           group=self.grid.get_pipe_parallel_group())
            self.dp_group_loss = losses[0].clone()
            if extra is not None:
                self.agg_additional_losses = OrderedDict(
                    (name, losses[2 + i].clone()) for i, name in enumerate(extra.keys()))
        if self.is_last_stage() and self.agg_additional_losses is not None:
            for i, name in enumerate(list(self.agg_additional_losses)):
                self.agg_additional_losses[name] = losses[2 + i].clone()
        return losses[1].clone()
