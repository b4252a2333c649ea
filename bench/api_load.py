"""API submission rate: how many ``POST /v1/jobs`` per second the API sustains (row in PostgreSQL, then XADD),
with submission latency p50/p99. The load generator is a second process (``python -m bench.api_load
--client ...``): closed loop, ``concurrency`` requests in flight, for ``duration`` seconds. No worker runs,
so jobs only queue (the tenant's queue cap is raised for the test)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench import common

TARGET = 500.0


async def _client(url: str, key: str, duration: float, concurrency: int) -> dict:
    # A bare HTTP/1.1 keep-alive client on asyncio streams: httpx costs ~2.4 ms of CPU per request, which on a
    # 2-core machine would leave the API less than half of the CPU it is being measured on.
    from urllib.parse import urlsplit

    lat: list[float] = []
    errors: dict[str, int] = {}
    body = {"prompt_ids": [100, 101, 102, 103, 104, 105, 106, 107], "max_tokens": 8, "tier": "batch"}
    host, port = urlsplit(url).hostname or "127.0.0.1", urlsplit(url).port or 80
    payload = json.dumps(body).encode()
    request = (f"POST /v1/jobs HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {key}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload
    stop_at = time.perf_counter() + duration

    async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[str, bool]:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        length, close = 0, False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection":
                close = value.strip().lower() == b"close"
        if length:
            await reader.readexactly(length)
        return head[9:12].decode(), close

    async def loop() -> None:
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            try:
                if conn is None:
                    conn = await asyncio.wait_for(asyncio.open_connection(host, port), 30)
                code, close = await asyncio.wait_for(exchange(*conn), 30)
                if close:
                    conn[1].close()
                    conn = None
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError,
                    ValueError) as exc:
                code = type(exc).__name__
                if conn is not None:
                    conn[1].close()
                    conn = None
            if code == "202":
                lat.append(time.perf_counter() - t0)
            else:
                errors[code] = errors.get(code, 0) + 1
        if conn is not None:
            conn[1].close()

    t_start = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    wall = time.perf_counter() - t_start
    return {"accepted": len(lat), "wall_s": wall, "rate": len(lat) / wall, "errors": errors,
            "p50_ms": 1000 * (common.percentile(lat, 50) or 0), "p99_ms": 1000 * (common.percentile(lat, 99) or 0),
            "mean_ms": 1000 * (common.mean(lat) or 0)}


def run(*, duration: float = 20.0, concurrency: tuple[int, ...] = (16, 64), api_workers: int = 1,
        quick: bool = False, out: str | Path | None = None, tag: str = "api", log=print) -> dict:
    from bench.tiers import Stack

    if quick:
        duration, concurrency = 2.0, (4,)
    info = common.machine_info()
    log(common.machine_line(info))
    rows = []
    with Stack(model="smollm2-135m-instruct", dtype="float32", kv_cache_memory="64MiB", worker=False,
               api_workers=api_workers, extra={"tier_queue_cap": 10_000_000}, log=log) as stack:
        for conc in concurrency:
            log(f"{conc} concurrent submitters for {duration:.0f} s ...")
            cmd = [sys.executable, "-m", "bench.api_load", "--client", stack.url, stack.key or "", str(duration),
                   str(conc)]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 120,
                               cwd=Path(__file__).resolve().parents[1])
            if r.returncode != 0:
                raise RuntimeError(f"load generator failed: {r.stderr[-2000:]}")
            res = json.loads(r.stdout.strip().splitlines()[-1])
            res["concurrency"] = conc
            rows.append(res)
            log(f"  {res['rate']:.0f} submissions/s, p50 {res['p50_ms']:.1f} ms, p99 {res['p99_ms']:.1f} ms, "
                f"errors {res['errors']}")
    best = max((r["rate"] for r in rows), default=0.0)
    result = {"benchmark": "api", "machine": info, "api_workers": api_workers, "duration_s": duration, "rows": rows,
              "best_rate": best, "targets": [{"target": f"API sustains >= {TARGET:.0f} submissions/s",
                                              "measured": best, "met": best >= TARGET}],
              "loadavg_end": os.getloadavg()}
    out_dir = common.results_dir(out)
    common.write_json(out_dir, tag, result)
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([str(r["concurrency"]) for r in rows], [r["rate"] for r in rows])
    for i, r in enumerate(rows):
        ax.text(i, r["rate"], f"p50 {r['p50_ms']:.0f} / p99 {r['p99_ms']:.0f} ms", ha="center", va="bottom", fontsize=8)
    ax.axhline(TARGET, color="gray", ls="--", label=f"target {TARGET:.0f}/s")
    ax.set_xlabel("concurrent submitters")
    ax.set_ylabel("accepted submissions / s")
    ax.legend(fontsize=8)
    ax.set_title(f"POST /v1/jobs ({api_workers} API process) - {info['cpu']}, {info['cores']} cores", fontsize=9)
    common.save_figure(fig, out_dir, tag)
    log("\n".join(common.target_lines(result["targets"])))
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["--client"]:
        url, key, duration, conc = sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
        sys.stdout.write(json.dumps(asyncio.run(_client(url, key, duration, conc))) + "\n")
    else:
        run()
