"""The replica's relay of a streamed body: every byte, in order, coalesced to at most one piece per interval."""

from __future__ import annotations

import asyncio
from unittest import mock

import aiohttp
import pytest

pytest.importorskip("ray", reason="the cluster extra is not installed")

from minibatch.daemon.cluster.replica import coalesced  # noqa: E402


async def relay(interval: float, pieces: int, gap: float) -> list[bytes]:
    reader = aiohttp.StreamReader(mock.Mock(_reading_paused=False), 2**16, loop=asyncio.get_running_loop())

    async def write() -> None:
        for i in range(pieces):
            reader.feed_data(b"data: %d\n\n" % i)
            await asyncio.sleep(gap)
        reader.feed_eof()

    writer = asyncio.ensure_future(write())
    out = [chunk async for chunk in coalesced(reader, interval)]
    await writer
    return out


def test_without_an_interval_each_piece_goes_as_it_comes():
    out = asyncio.run(relay(0.0, 20, 0.002))
    assert b"".join(out) == b"".join(b"data: %d\n\n" % i for i in range(20))
    assert len(out) >= 15  # (a piece may land while the last one is read)


def test_an_interval_coalesces_and_keeps_every_byte_in_order():
    out = asyncio.run(relay(0.05, 40, 0.005))  # 40 pieces over ~0.2 s, 50 ms windows
    assert b"".join(out) == b"".join(b"data: %d\n\n" % i for i in range(40))
    assert out[0] == b"data: 0\n\n"  # the first goes at once
    assert 3 <= len(out) <= 8
