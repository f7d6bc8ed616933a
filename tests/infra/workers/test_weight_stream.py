"""The weight sync's wire: `WeightStream` packs, broadcasts and receives a model one bucket at a time.

Two gloo ranks in two threads of this process (no Ray): rank 0 packs tensors from a lazy source and sends, rank 1
receives; both checksums and every received value are checked against the source cast to the wire dtype by hand.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from infra.workers.distributed import (
    TensorSpec,
    WeightGroup,
    WeightStream,
    buckets,
    checksum,
    combine,
    receive_into,
)


def model_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(10, 6, generator=g), "layer.0.weight": torch.randn(6, 6, generator=g),
            "layer.0.bias": torch.randn(6, generator=g), "head.weight": torch.randn(4, 6, generator=g)}


def layout_of(state, dtype: str) -> list[TensorSpec]:
    return [TensorSpec(k, tuple(v.shape), dtype) for k, v in state.items()]


BUCKET = 100  # bytes: splits the model into several buckets, a larger tensor alone in its own


def test_packing_yields_views_of_one_bucket_at_a_time_and_checksums_them():
    state = model_state()
    layout = layout_of(state, "bfloat16")
    asked = []

    def source():  # lazy, as a sharded trainer gathers: record when each tensor is asked for
        for name, value in state.items():
            asked.append(name)
            yield name, value

    stream = WeightStream(layout, torch.device("cpu"), source=source(), bucket_bytes=BUCKET)
    got = {}
    for name, value in stream:
        # a bucket's tensors are asked for only when that bucket is packed, never the whole model up front
        bucket = next(b for b in buckets(layout, BUCKET) if name in [layout[i].name for i in b])
        assert asked[-1] == layout[bucket[-1]].name
        got[name] = value.clone()
    groups = buckets(layout, BUCKET)
    assert len(groups) >= 3
    expected = combine([checksum(torch.cat([state[layout[i].name].reshape(-1).to(torch.bfloat16) for i in b]))
                        for b in groups])
    assert stream.checksum == expected
    assert stream.bytes == 2 * sum(v.numel() for v in state.values())
    for name, value in state.items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], value.to(torch.bfloat16))


def test_with_a_group_the_next_bucket_travels_while_the_consumer_takes_this_one():
    """Double-buffered: bucket k+1 is packed and its broadcast posted before bucket k's tensors are handed over, and
    bucket k's broadcast has ended (waited) when they are; never more than two buckets in flight."""
    state = model_state()
    layout = layout_of(state, "float32")
    events: list[tuple[str, int]] = []

    class Recording:  # a WeightGroup's one call: the broadcast in flight, ended by its work's wait()
        def broadcast(self, flat):
            k = sum(1 for e in events if e[0] == "post")
            events.append(("post", k))

            class Work:
                def wait(self):
                    events.append(("wait", k))
            return Work()

    groups = buckets(layout, BUCKET)
    first_of = {layout[b[0]].name: k for k, b in enumerate(groups)}
    stream = WeightStream(layout, torch.device("cpu"), group=Recording(), source=iter(state.items()),
                          bucket_bytes=BUCKET)
    got = {}
    for name, value in stream:
        if name in first_of:
            events.append(("take", first_of[name]))
        got[name] = value.clone()
    n = len(groups)
    assert n >= 3
    expected = [("post", 0)] + [e for k in range(n) for e in
                                ([("post", k + 1)] if k + 1 < n else []) + [("wait", k), ("take", k)]]
    assert events == expected
    for name, value in state.items():
        assert torch.equal(got[name], value)


def test_a_source_out_of_layout_order_is_refused_and_the_checksum_waits_for_the_end():
    state = model_state()
    layout = layout_of(state, "float32")
    backwards = WeightStream(layout, torch.device("cpu"), source=reversed(list(state.items())))
    with pytest.raises(ValueError, match="'head.weight' arrived where the layout has 'embed.weight'"):
        next(iter(backwards))
    partial = WeightStream(layout, torch.device("cpu"), source=state.items())
    next(iter(partial))
    with pytest.raises(RuntimeError, match="before the stream was read to its end"):
        _ = partial.checksum
    assert partial.drain().checksum == WeightStream(layout, torch.device("cpu"), source=state.items()).drain().checksum


def test_rank_zero_sends_and_an_engine_receives_into_its_own_parameters():
    state = model_state()
    layout = layout_of(state, "float32")
    store = dist.HashStore()
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    held = dict(targets)  # the engine's parameter objects: received in place, no second copy
    out: dict[str, object] = {}

    def rank(r: int) -> None:
        try:
            group = WeightGroup(store, r, 2, "gloo", "127.0.0.1")
            if r == 0:
                stream = WeightStream(layout, torch.device("cpu"), group=group, source=iter(state.items()),
                                      bucket_bytes=BUCKET).drain()
            else:
                stream = WeightStream(layout, torch.device("cpu"), group=group, bucket_bytes=BUCKET)
                receive_into(stream, targets)
            out[r] = (stream.checksum, stream.bytes)
            group.close()
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert out[0] == out[1] and out[0][1] == 4 * sum(v.numel() for v in state.values()), out
    for name, value in state.items():
        assert targets[name] is held[name] and torch.equal(targets[name], value)
