"""The streamed fill of a restore that reads the SSD tier (docs/DESIGN.md §9): the K/V of
each entry is copied into the restored cache's buffers as soon as it is loaded, while the
SSD reader threads read the files after it (:meth:`~.ssd.reader.SSDReader.read_ahead`),
instead of one concatenate per array after the last load. The bytes and their order are
those of :meth:`.layers.KVLeaf.restore` (one buffer per array, padded with zeros to
:meth:`~.layers.KVLeaf.padded_length`), so the cache is the same bit for bit; only the
copy moves from after the reads to beside them.

Engine thread only (it builds MLX graphs). The copies are slice updates of buffers that
nothing else holds, so MLX writes them in place (as ``KVCache.update_and_fetch`` does).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from .blocks import Entry
from .layers import Arrays, KVLeaf

EVAL_BYTES = 64 << 20  # the copies queued before they are started (bytes)


class StreamedFill:
    """The buffers of the K/V leaves ``leaves`` (none cut from the resident cache) of a
    restore at ``position`` tokens, filled from position 0 in token order by :meth:`add`,
    then handed to each leaf by :meth:`adopt`. Each buffer is ``(B, n_kv_heads,
    padded_length(max(position, length)), head_dim)`` (quantized caches: each of
    ``k0..k2``/``v0..v2`` with its token axis 2), shaped and typed after the first entry's
    arrays, zeros after ``position``. ``length``: the tokens the cache is about to hold
    (the whole prompt and a first decoded token), so that the prefill of the prompt's rest
    writes in place: mlx-lm's ``KVCache`` grows by concatenating its whole buffer with a
    new one whenever a chunk does not fit, which after a long restore is a second copy of
    everything restored."""

    def __init__(
        self,
        leaves: Sequence[KVLeaf],
        position: int,
        length: int = 0,
        eval_bytes: int = EVAL_BYTES,
    ) -> None:
        self.leaves = tuple(leaves)
        self.position = position
        self.length = KVLeaf.padded_length(max(position, length))
        self.eval_bytes = eval_bytes
        self.buffers: dict[str, Arrays] = {lf.name: {} for lf in self.leaves}
        self.filled = 0  # tokens placed so far, from position 0
        self.nbytes = 0  # bytes copied so far (queued ones included)
        self._queued = 0  # bytes copied since the last flush

    def add(self, e: Entry, tokens: int) -> None:
        """Copy the first ``tokens`` tokens of ``e``'s K/V of every leaf to the next
        positions (:attr:`filled` onwards); started (:meth:`flush`) once :data:`EVAL_BYTES`
        are queued.

        Raises:
            ValueError: past ``position``, or ``e`` lacks a leaf's arrays.
        """
        start, end = self.filled, self.filled + tokens
        if end > self.position:
            raise ValueError(f"tokens {start}..{end} past the restore position {self.position}")
        by_leaf: dict[str, Arrays] = {}
        for key, a in e.arrays.items():  # "<leaf>.<part>"; a leaf's name may hold dots
            leaf_name, _, name = key.rpartition(".")
            by_leaf.setdefault(leaf_name, {})[name] = a
        for leaf in self.leaves:
            parts = by_leaf.get(leaf.name)
            if not parts:
                raise ValueError(f"entry {e.id[:12]} has no arrays of leaf {leaf.name}")
            buffers = self.buffers[leaf.name]
            for name, a in parts.items():
                part = a if a.shape[2] == tokens else a[..., :tokens, :]
                if name not in buffers:
                    shape = list(a.shape)
                    shape[2] = self.length
                    buffers[name] = mx.zeros(shape, a.dtype)
                buffers[name][..., start:end, :] = part
                self._queued += part.nbytes
                self.nbytes += part.nbytes
        self.filled = end
        if self._queued >= self.eval_bytes:
            self.flush()

    def flush(self) -> None:
        """Start the copies queued so far (``mx.async_eval``): MLX's stream makes them
        while the engine thread takes the next entries; whoever evaluates the cache (the
        restore's fill) waits for them."""
        mx.async_eval([a for b in self.buffers.values() for a in b.values()])
        self._queued = 0

    @property
    def complete(self) -> bool:
        """Whether every position up to ``position`` was filled."""
        return self.filled == self.position

    def adopt(self, leaf: KVLeaf, c) -> None:
        """Give ``leaf``'s buffers to its fresh cache ``c`` (:meth:`.layers.KVLeaf.adopt`).

        Raises:
            ValueError: not :attr:`complete`.
        """
        if not self.complete:
            raise ValueError(f"filled {self.filled} of {self.position} tokens")
        leaf.adopt(c, self.buffers[leaf.name], self.position)
