"""Take the screenshot of the /dashboard page in docs/img/dashboard.png.

    .venv/bin/python scripts/dashboard_screenshot.py [--out docs/img/dashboard.png]

Starts `radixrt serve` on the embedded model (a small KV pool over a host
tier, so that eviction and host nodes show), runs agents that share a system
prompt and fork (some in their own cache namespace) while headless Chromium
(`chromium` on the PATH; Debian: apt-get install chromium) renders the page
with decoded text for a few seconds, and saves what it shows.
"""

from __future__ import annotations

import argparse
import random
import shutil
import subprocess
import sys
import threading
import time

import httpx

from radixrt.server.local import LocalServer

SYSTEM = "You are a travel agent. Plan trips, book trains and hotels, and answer in short sentences. "


def load(url: str, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    cities = ["Lyon", "Turin", "Ghent", "Porto", "Basel", "Graz", "Split", "Bergen"]
    with httpx.Client(base_url=url, timeout=120) as c:
        while not stop.is_set():
            city = rng.choice(cities)
            body = {
                "text": [SYSTEM + f"User: two days in {city}, by train. Day {d}:" for d in (1, 2)],
                "sampling_params": {"max_new_tokens": rng.randint(24, 64), "temperature": 0.7},
            }
            if seed % 3 == 2:
                body["cache_salt"] = f"tenant-{seed}"
            c.post("/generate", json=body)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs/img/dashboard.png")
    p.add_argument("--seconds", type=float, default=12.0, help="load before the shot")
    args = p.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("no chromium on the PATH", file=sys.stderr)
        return 1
    srv = LocalServer("--max-total-tokens", "1200", "--host-kv-size", "4000", model="default").wait_ready()
    stop = threading.Event()
    workers = [threading.Thread(target=load, args=(srv.url, stop, i), daemon=True) for i in range(6)]
    try:
        for w in workers:
            w.start()
        time.sleep(args.seconds)
        cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1400,900"]
        cmd += ["--virtual-time-budget=8000", f"--screenshot={args.out}", f"{srv.url}/dashboard#text=1&rate=4&depth=10"]
        subprocess.run(cmd, capture_output=True, timeout=180, check=True)
        print("saved", args.out)
    finally:
        stop.set()
        srv.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
