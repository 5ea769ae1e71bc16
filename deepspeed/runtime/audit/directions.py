# SPDX-License-Identifier: Apache-2.0
"""Random directions that every rank can generate for its own piece of a parameter only.

Direction ``k`` gives element ``j`` of parameter ``i`` (``i`` the parameter's position in
``module.named_parameters()``, ``j`` an index into its flat view) a standard normal value. The
values are a pure function of ``(seed, k, i, j)``: the flat view is cut into chunks of
``CHUNK`` elements, and chunk ``c`` is drawn by torch's generator on the piece's device,
seeded with a 63-bit mix of ``(seed, k, i, c)`` (counter-based seeding). So

* a rank holding elements ``[start, start + length)`` draws only the chunks that overlap
  them (at most two more chunks than it keeps per parameter: memory and time stay bounded
  by its piece, never by the whole parameter or model);
* every rank that holds element ``j`` holds the same value for it, whatever the partition:
  the chunk boundaries depend on the parameter alone.

Why chunks and not one generator per parameter skipped forward: skipping ahead in torch's
generators means drawing and discarding, which would cost a rank with the last shard of a
large parameter the whole parameter's worth of draws. Why torch's generator and not a hash
of our own: drawing is one fused kernel per chunk (a hash would be a dozen element-wise
passes). The values depend on the device type (CPU and CUDA generators differ), so they
are identical across ranks of one job, whose pieces live on the same kind of device; the
audit checks that on replicated stages (see ``auditor.py``).
"""

import torch

CHUNK = 1 << 20
_MASK64 = (1 << 64) - 1


def _splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(*words):
    """A 63-bit generator seed from integers (a hash: nearby inputs give unrelated seeds)."""
    x = 0
    for word in words:
        x = _splitmix64(x ^ (int(word) & _MASK64))
    return x >> 1


class DirectionStream:
    """Standard normal values of direction ``k`` for any range of any parameter (see the module docstring)."""

    def __init__(self, seed, chunk=CHUNK):
        self.seed = int(seed)
        self.chunk = int(chunk)
        self._generators = {}

    def _generator(self, device):
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
        return generator

    def pieces(self, k, param_index, numel, start, length, device):
        """Yield ``(offset, values)`` covering elements ``[start, start + length)`` of a ``numel``-element parameter.

        ``offset`` counts from ``start``; ``values`` is a float32 tensor on ``device``. The pieces are
        consecutive and at most ``chunk`` long.
        """
        if length <= 0:
            return
        if start < 0 or start + length > numel:
            raise ValueError(f"range [{start}, {start + length}) is outside a parameter of {numel} elements")
        device = torch.device(device)
        chunk = self.chunk
        generator = self._generator(device)
        end = start + length
        for c in range(start // chunk, (end - 1) // chunk + 1):
            lo = c * chunk
            size = min(chunk, numel - lo)
            generator.manual_seed(mix_seed(self.seed, k, param_index, c))
            values = torch.randn(size, generator=generator, device=device, dtype=torch.float32)
            take_lo, take_hi = max(start, lo), min(end, lo + size)
            yield take_lo - start, values[take_lo - lo:take_hi - lo]

    def full(self, k, param_index, numel, device="cpu"):
        """All ``numel`` values of one parameter (for tests and references)."""
        out = torch.empty(numel, dtype=torch.float32, device=device)
        for offset, values in self.pieces(k, param_index, numel, 0, numel, device):
            out[offset:offset + values.numel()] = values
        return out
