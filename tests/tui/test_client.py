"""The chat's client against the real daemon (tiny model): paced streams."""

from __future__ import annotations

import asyncio
import time

from minibatch.tui.client import DaemonClient
from tests.daemon.helpers import Daemon

QUESTION = [{"role": "user", "content": "Count to twenty, please."}]


async def answer(client: DaemonClient) -> tuple[list[str], float]:
    t0 = time.monotonic()
    pieces = [d.text async for d in client.chat(QUESTION, max_tokens=80, temperature=0, ignore_eos=True) if d.text]
    await client.close()
    return pieces, time.monotonic() - t0


def test_a_client_with_a_stream_interval_gets_the_same_answer_in_fewer_pieces(tiny_chat_model_dir, short_tmp):
    daemon = Daemon(short_tmp / "d.sock", tiny_chat_model_dir, "--kv-cache-gb", "0.05").wait_ready()
    try:
        plain, _ = asyncio.run(answer(DaemonClient(str(daemon.socket))))
        paced, elapsed = asyncio.run(answer(DaemonClient(str(daemon.socket), stream_interval=0.04)))
    finally:
        assert daemon.stop() == 0, daemon.log_text()
    assert "".join(paced) == "".join(plain) and len(plain) >= 40  # a piece per token, near enough
    assert len(paced) <= 2 + elapsed / 0.04  # the first piece, then one per 40 ms at most
