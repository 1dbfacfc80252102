"""``python -m benchmarks.gateway``: fetch throughput through the trustless gateway against local
reads, and what a lying gateway costs the fetcher.

Objects of each ``--mib`` size (random bytes, so nothing compresses) are put in an on-disk store
(storage_client.ObjectStore) and read ``--repeat`` times three ways, each read verified against its
CID: ``local`` (ObjectStore.get: read + sha256), ``http`` and ``https`` (RemoteStore.get through
storage_client.gateway on loopback: the server re-hashes before sending, the client re-hashes on
arrival; https with a self-signed certificate, trainer.net.tls). MiB/s is size / median time.

Then the lies, each against one gateway and a fetcher with no retries: ``wrong bytes`` (a store that
flips one byte; the fetcher names the CID and the source that lied), ``liar, then honest`` (the
same liar first, an honest gateway second: the fetcher moves on), ``truncated`` (a server that
declares a length and closes early), ``slow drip`` (one byte every 50 ms, cut off after the
fetcher's ``timeout_s``, 1 s here, plus the time the minimum rate allows) and a ``truncated CAR``
(storage_client.car.read_car on a CAR missing its last 10 bytes). Each row says what the fetcher
raised and how long it took to give up.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

from storage_client import CID, ObjectStore
from storage_client.car import CarError, encode_car, read_car
from storage_client.gateway import server_tls, start_gateway
from storage_client.remote import RemoteStore


class FlippingStore(ObjectStore):
    """A store whose reads come back with one byte flipped: behind a gateway, a gateway that lies."""

    def get(self, cid):  # type: ignore[override]
        data = bytearray(super().get(cid))
        data[len(data) // 2] ^= 1
        return bytes(data)


def _median_s(read, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        read()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def hostile_server(reply_head: bytes, body: bytes, drip_s: float = 0.0) -> str:
    """The URL of a one-connection server that answers any request with ``reply_head`` then ``body``,
    one byte per ``drip_s`` seconds when that is set, and closes: a gateway that truncates or drips."""
    listener = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        conn, _ = listener.accept()
        conn.recv(4096)
        try:
            conn.sendall(reply_head)
            for i in range(len(body)):
                conn.sendall(body[i:i + 1])
                if drip_s:
                    time.sleep(drip_s)
        except OSError:
            pass
        conn.close()
        listener.close()

    threading.Thread(target=answer, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}"


def _outcome(fetch) -> tuple[str, float]:
    started = time.perf_counter()
    try:
        what = "verified bytes returned" if fetch() else "accepted (WRONG)"
    except (CarError, ValueError) as exc:
        what = f"{type(exc).__name__}: {str(exc)[:110]}"
    return what, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gateway", description=__doc__)
    parser.add_argument("--mib", type=float, nargs="+", default=[0.25, 4, 32], help="object sizes in MiB")
    parser.add_argument("--repeat", type=int, default=5, help="reads per size and way (median)")
    args = parser.parse_args(argv)
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, loopback")
    with tempfile.TemporaryDirectory(prefix="dilocox-gw-bench-") as tmp:
        from trainer.net.tls import ensure_self_signed

        store = ObjectStore(Path(tmp) / "store")
        identity = ensure_self_signed(Path(tmp) / "tls", ["127.0.0.1"])
        plain, _ = start_gateway(store)
        secure, _ = start_gateway(store, tls=server_tls(identity.cert_path, identity.key_path))
        ways = {"local": store, "http": RemoteStore([plain.url]),
                "https": RemoteStore([secure.url], ca_file=str(identity.cert_path))}
        print(f"\n{'size MiB':>9} | " + " | ".join(f"{w + ' MiB/s':>12}" for w in ways))
        for mib in args.mib:
            cid = store.put(os.urandom(int(mib * (1 << 20))))
            rates = [mib / _median_s(lambda s=s: s.get(cid), args.repeat) for s in ways.values()]
            print(f"{mib:>9g} | " + " | ".join(f"{r:>12.0f}" for r in rates))

        print("\nwhen the gateway lies (1 MiB object, no retries):")
        liar = FlippingStore(Path(tmp) / "liar")
        data = os.urandom(1 << 20)
        cid = liar.put(data)
        lying, _ = start_gateway(liar)
        head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        car = b"".join(encode_car([cid], [(cid, data)]))
        rows = {
            "wrong bytes": lambda: RemoteStore([lying.url], retries=0).get(cid) == data,
            "truncated": lambda: RemoteStore([hostile_server(head, data[:1000], 0)], retries=0).get(cid) == data,
            "slow drip": lambda: RemoteStore([hostile_server(head, data[:200], 0.05)], retries=0, timeout_s=1).get(cid) == data,
            "truncated CAR": lambda: read_car(io.BytesIO(car[:-10])).blocks == [(cid, data)],
            "liar, then honest": lambda: RemoteStore([lying.url, plain.url], retries=0).get(store.put(data)) == data,
        }
        for name, fetch in rows.items():
            what, seconds = _outcome(fetch)
            print(f"{name:>18} | {seconds:6.2f} s | {what}")
        for server in (plain, secure, lying):
            server.shutdown()
            server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
