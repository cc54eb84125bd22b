"""Prefix-cache hit rate of SGLang workers, from their Prometheus ``/metrics``.

The paper's hit rate: cached prompt tokens / prompt tokens, i.e.
``sglang:cached_tokens_total / sglang:prompt_tokens_total`` (summed over label sets; SGLang
needs ``--enable-metrics``). With ``--watch S`` it prints the rate over each S-second window
as well, so a warm-up does not hide what the cache does now. Evictions appear as
``sglang:evicted_tokens_total`` for either backend. Standard library only:

    python examples/sglang_rlt/hit_rate.py http://127.0.0.1:30000
    python examples/sglang_rlt/hit_rate.py http://gpu-a:30000 http://gpu-b:30000 --watch 30
"""

from __future__ import annotations

import argparse
import time
import urllib.request

CACHED, PROMPT, EVICTED = (
    "sglang:cached_tokens_total",
    "sglang:prompt_tokens_total",
    "sglang:evicted_tokens_total",
)


def scrape(url: str) -> dict[str, float]:
    """Sum every sample of the three counters in one worker's /metrics text."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as response:
        text = response.read().decode()
    totals = dict.fromkeys((CACHED, PROMPT, EVICTED), 0.0)
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def rate(cached: float, prompt: float) -> str:
    return f"{cached / prompt:.3f}" if prompt else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("urls", nargs="+", help="worker base URLs")
    parser.add_argument("--watch", type=float, default=0.0, help="seconds between reports")
    args = parser.parse_args()
    before = {url: scrape(url) for url in args.urls}
    while True:
        for url in args.urls:
            now = scrape(url)
            cached, prompt = now[CACHED], now[PROMPT]
            window = rate(cached - before[url][CACHED], prompt - before[url][PROMPT])
            print(
                f"{url}: hit rate {rate(cached, prompt)} since start"
                + (f", {window} in the last window" if args.watch else "")
                + f"; {int(prompt):,} prompt tokens, {int(now[EVICTED]):,} evicted"
            )
            before[url] = now
        if not args.watch:
            return
        time.sleep(args.watch)


if __name__ == "__main__":
    main()
