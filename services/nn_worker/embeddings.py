"""A lookup's embeddings as the step takes them, and the step's gradients of them as the wire
carries them back: the NN rank's two conversions between the embedding worker's protobuf
messages and numpy arrays (the arrays inside are the one codec's frames)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trillium.wire import codec
from trillium.wire.pb import embedding_pb2 as pb


@dataclass(frozen=True)
class SlotEmbeddings:
    """A batch's embeddings, slot by slot, in the form the wire carries them (TorchRec's
    KeyedTensor, in numpy): the pooled slots side by side in one float32 block, each sequence slot
    apart. A step takes its embeddings in this form and gives their gradients back in it: one
    autograd leaf for the block, and no per-slot copies on either side."""

    pooled: np.ndarray  # float32 [B, sum of the pooled slots' dims], writable
    widths: list[int]  # per slot, in slot order: its columns in `pooled` (0: a sequence slot)
    sequences: list[np.ndarray]  # float32 [B, max_len, dim] per sequence slot, in slot order

    @classmethod
    def of(cls, slots: Sequence[np.ndarray]) -> SlotEmbeddings:
        """From one float32 array per slot, in slot order: [B, dim] pooled, [B, max_len, dim] a
        sequence (the pooled ones copied side by side)."""
        pooled = [s for s in slots if s.ndim == 2]
        rows = len(slots[0]) if len(slots) else 0
        return cls(
            np.concatenate(pooled, axis=1, dtype=np.float32) if pooled else np.zeros((rows, 0), np.float32),
            [s.shape[1] if s.ndim == 2 else 0 for s in slots],
            [np.array(s, dtype=np.float32) for s in slots if s.ndim != 2],
        )

    def slots(self) -> list[np.ndarray]:
        """One array per slot, in slot order: a pooled slot's columns of `pooled` (views)."""
        sequences, out, start = iter(self.sequences), [], 0
        for width in self.widths:
            if width:
                out.append(self.pooled[:, start : start + width])
                start += width
            else:
                out.append(next(sequences))
        return out


def embeddings_of(response: pb.BatchLookupResponse) -> SlotEmbeddings:
    """A lookup's embeddings as float32 copies (torch wants writable arrays, and fp16 wire values
    become float32)."""
    return SlotEmbeddings(
        _float32(codec.unpack_array(response.pooled.data)),
        list(response.widths),
        [_float32(codec.unpack_array(s.values.data)) for s in response.slots],
    )


def _float32(values: np.ndarray) -> np.ndarray:
    """A writable float32 copy (fp16 widened in the native core: numpy's cast is 10× slower)."""
    return codec.from_fp16(values, 1.0) if values.dtype == np.float16 else np.array(values, dtype=np.float32)


def gradients_request(
    response: pb.BatchLookupResponse, grads: SlotEmbeddings, *, fp16: bool = False
) -> pb.PushGradientsRequest:
    """The gradients of a lookup's embeddings as the wire carries them: with `fp16`, the pooled
    ones scaled and cast (`codec.to_fp16`)."""
    pooled, scale = codec.to_fp16(grads.pooled) if fp16 else (grads.pooled, 1.0)
    return pb.PushGradientsRequest(
        ref=response.ref,
        pooled=pb.Array(data=codec.pack_array(pooled)),
        pooled_scale=scale,
        slots=[
            pb.SlotGradient(slot=s.slot, grad=pb.Array(data=codec.pack_array(g)))
            for s, g in zip(response.slots, grads.sequences, strict=True)
        ],
    )
