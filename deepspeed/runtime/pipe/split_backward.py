# SPDX-License-Identifier: Apache-2.0
"""The backward of one pipeline buffer in two halves: input gradients now, weight gradients later (zero bubble).

:meth:`SplitBackward.input_pass` runs ``torch.autograd.grad`` from the stage's roots (the seeded loss, or the
outputs with the received gradients) to the stage's inputs, keeping the graph. Before it runs, the graph is read
(torch's pipelining helpers ``construct_reverse_graph`` / ``get_param_groups``): every group of parameters whose
gradient flows through the path to the inputs gets a hook on the nodes where that path meets it (the
*intermediates*), which saves the gradients arriving there. The inputs' gradients go to their ``.grad`` for the
transfer to the previous stage.

:meth:`SplitBackward.weight_pass` then computes each group's parameter gradients from its saved gradients alone
(``torch.autograd.grad`` from the intermediates' gradient edges to the parameters' accumulation nodes; where a
group has several intermediates, their incoming gradients are replaced by the saved ones, so no path is counted
twice), and the parameters whose gradient does not meet the inputs' path (a first stage, whose inputs need no
gradient) from the roots. The gradients go to the stage's gradient pipeline through an explicit backward session
with the seed of a whole backward: the same factor, the same buckets, the same epilogue. Both halves run with
sessions suspended, so no hook of the engine sees them.
"""

import torch

from deepspeed.runtime.backward import registry

_HELPERS = None


def _helpers():
    global _HELPERS
    if _HELPERS is None:
        from torch.autograd.graph import GradientEdge
        from torch.distributed.pipelining._backward import (_get_grad_fn_or_grad_acc, construct_reverse_graph,
                                                            get_param_groups)
        _HELPERS = (GradientEdge, _get_grad_fn_or_grad_acc, construct_reverse_graph, get_param_groups)
    return _HELPERS


def check_available():
    """NotImplementedError (the same on every rank) when this torch lacks what the split needs."""
    try:
        _helpers()
    except ImportError as exc:
        raise NotImplementedError(
            f"pipeline.schedule 'zero_bubble' needs torch.distributed.pipelining's graph "
            f"helpers, which this torch lacks ({exc}); use '1f1b' or 'interleaved_1f1b'") from exc


class SplitBackward:
    """One buffer's backward, between its two halves (module docstring)."""

    def __init__(self, roots, root_grads, inputs, params):
        self.roots = list(roots)
        self.root_grads = root_grads
        self.inputs = [t for t in inputs if t.requires_grad]
        self.params = [p for p in params if p.requires_grad]
        self.groups = []
        self.uncovered = []

    def input_pass(self):
        """The inputs' gradients (also left in their ``.grad``); the intermediates' gradients are kept."""
        GradientEdge, grad_fn_of, reverse_graph, param_groups = _helpers()
        with registry.suspended():
            accumulators = {}
            for p in self.params:
                node = grad_fn_of(p)
                if node is not None:
                    accumulators[node] = p
            self.accumulators = accumulators
            roots = [fn for fn in (grad_fn_of(t) for t in self.roots) if fn is not None]
            input_fns = [fn for fn in (grad_fn_of(t) for t in self.inputs) if fn is not None]
            groups = param_groups(input_fns, list(accumulators), reverse_graph(roots)) if input_fns else []
            covered = set()
            handles = []
            for group in groups:
                group["intermediates"] = list(group["intermediates"])
                group["grads"] = [None] * len(group["intermediates"])
                covered |= set(group["params"])
                for index, node in enumerate(group["intermediates"]):
                    handles.append(node.register_prehook(_saver(group, index)))
            self.groups = [g for g in groups if g["intermediates"]]
            self.uncovered = [p for node, p in accumulators.items() if node not in covered]
            try:
                if self.inputs:
                    grads = torch.autograd.grad(self.roots,
                                                self.inputs,
                                                grad_outputs=self.root_grads,
                                                retain_graph=True,
                                                allow_unused=True)
                else:
                    grads = []
            finally:
                for handle in handles:
                    handle.remove()
        for t, g in zip(self.inputs, grads):
            if g is not None:
                t.grad = g if t.grad is None else t.grad + g
        if not self.uncovered:  # the roots are not needed by the weight pass
            self.roots, self.root_grads = None, None
        return grads

    def weight_pass(self, seed, pipeline):
        """Compute the parameters' gradients and hand them to ``pipeline`` with ``seed``'s factor."""
        GradientEdge = _helpers()[0]
        results = []  # (param, grad)
        calls = [g for g in self.groups if any(x is not None for grads in g["grads"] for x in (grads or ()))]
        with registry.suspended():
            for n, group in enumerate(calls):
                edges, outputs = [], []
                for node, grads in zip(group["intermediates"], group["grads"]):
                    for i, grad in enumerate(grads or ()):
                        if grad is not None:
                            edges.append(GradientEdge(node, i))
                            outputs.append(grad)
                handles = []
                if len(group["intermediates"]) > 1:  # saved gradients replace what would flow in again
                    for node, grads in zip(group["intermediates"], group["grads"]):
                        handles.append(node.register_prehook(lambda _, saved=grads: saved))
                params = list(group["params"])
                try:
                    grads = torch.autograd.grad(edges, [GradientEdge(p, 0) for p in params],
                                                grad_outputs=outputs,
                                                retain_graph=bool(self.uncovered) or n < len(calls) - 1,
                                                allow_unused=True)
                finally:
                    for handle in handles:
                        handle.remove()
                results += [(self.accumulators[p], g) for p, g in zip(params, grads) if g is not None]
            if self.uncovered:
                grads = torch.autograd.grad(self.roots,
                                            self.uncovered,
                                            grad_outputs=self.root_grads,
                                            allow_unused=True)
                results += [(p, g) for p, g in zip(self.uncovered, grads) if g is not None]
        self.groups, self.roots, self.root_grads = [], None, None
        with registry.explicit_session(seed) as session:
            for param, grad in results:
                session.contribute_gradient(param, grad, pipeline)
        return [p for p, _ in results]


def _saver(group, index):

    def save(grad_outputs):
        group["grads"][index] = grad_outputs

    return save
