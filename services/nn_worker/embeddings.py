"""A lookup's embeddings as the step takes them, and the step's gradients of them as the wire
carries them back: the NN rank's two conversions between the embedding worker's protobuf
messages and numpy arrays (the arrays inside are the one codec's frames)."""

from __future__ import annotations

import numpy as np

from trillium.wire import codec
from trillium.wire.pb import embedding_pb2 as pb


def embeddings_of(response: pb.BatchLookupResponse) -> list[np.ndarray]:
    """A lookup's embeddings, one float32 array per slot in slot order: a pooled slot's are its
    columns of one copy of the wire's `pooled` (a copy: torch wants writable arrays, and fp16
    wire values become float32), a sequence slot's a copy of its own."""
    pooled = _float32(codec.unpack_array(response.pooled.data))
    sequences = iter(response.slots)
    out, start = [], 0
    for width in response.widths:
        if width:
            out.append(pooled[:, start : start + width])
            start += width
        else:
            out.append(_float32(codec.unpack_array(next(sequences).values.data)))
    return out


def _float32(values: np.ndarray) -> np.ndarray:
    """A writable float32 copy (fp16 widened in the native core: numpy's cast is 10× slower)."""
    return codec.from_fp16(values, 1.0) if values.dtype == np.float16 else np.array(values, dtype=np.float32)


def gradients_request(
    response: pb.BatchLookupResponse, grads: list[np.ndarray], *, fp16: bool = False
) -> pb.PushGradientsRequest:
    """The gradients of a lookup's embeddings (`embeddings_of`'s order) as the wire carries them:
    with `fp16`, the pooled ones scaled and cast (`codec.to_fp16`)."""
    pooled = [g for g, width in zip(grads, response.widths, strict=True) if width]
    sequences = [
        (s.slot, g)
        for s, g in zip(response.slots, (g for g, w in zip(grads, response.widths, strict=True) if not w), strict=True)
    ]
    joined = np.concatenate(pooled, axis=1) if pooled else np.zeros((len(grads[0]) if grads else 0, 0), np.float32)
    joined, scale = codec.to_fp16(joined) if fp16 else (joined, 1.0)
    return pb.PushGradientsRequest(
        ref=response.ref,
        pooled=pb.Array(data=codec.pack_array(joined)),
        pooled_scale=scale,
        slots=[pb.SlotGradient(slot=slot, grad=pb.Array(data=codec.pack_array(g))) for slot, g in sequences],
    )
