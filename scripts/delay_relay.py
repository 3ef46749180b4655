"""A TCP relay on loopback that delays each direction by D milliseconds: a slow link, made here.

    python scripts/delay_relay.py LISTEN_PORT TARGET_HOST:TARGET_PORT --delay-ms D

Every chunk read from one side is written to the other D ms after it arrived, in order, so a
request and its answer cross it in 2 D plus the transfer (a round trip on a network D ms away).
Bandwidth is not limited. For the `rpc` benchmark scenario (`python -m scripts.bench rpc`):
speculate's target on an RPC server behind it.
"""

from __future__ import annotations

import argparse
import asyncio
import time


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Forward what `reader` gives to `writer`, each chunk `delay` seconds after it came."""
    queue: asyncio.Queue = asyncio.Queue()

    async def send() -> None:
        while (item := await queue.get()) is not None:
            due, data = item
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.close()

    sender = asyncio.create_task(send())
    try:
        while data := await reader.read(1 << 16):
            queue.put_nowait((time.monotonic() + delay, data))
    finally:
        queue.put_nowait(None)
        await sender


async def serve(listen: int, host: str, port: int, delay: float) -> None:
    async def relay(client_reader, client_writer) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(host, port)
        except OSError:
            client_writer.close()
            return
        for sock in (client_writer, server_writer):  # small RPC messages must not wait for Nagle
            sock.get_extra_info("socket").setsockopt(6, 1, 1)  # IPPROTO_TCP, TCP_NODELAY
        await asyncio.gather(pipe(client_reader, server_writer, delay), pipe(server_reader, client_writer, delay),
                             return_exceptions=True)

    server = await asyncio.start_server(relay, "127.0.0.1", listen)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("listen_port", type=int)
    parser.add_argument("target", help="HOST:PORT to relay to")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="added to each direction")
    args = parser.parse_args()
    host, port = args.target.rsplit(":", 1)
    try:
        asyncio.run(serve(args.listen_port, host, int(port), args.delay_ms / 1000))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
