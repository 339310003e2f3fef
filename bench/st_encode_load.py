"""sentence-transformers' encode() in-process, the peer a user would run instead of a server
(bench/http_benchmark.sh): the same model directory, the same sentences, closed loop.

  python bench/st_encode_load.py --model DIR --sentences FILE --duration_s 8 --warmup 2 --threads N

With one sentence in FILE each call encodes it alone (a client's request, with no network); with 16,
each call encodes all 16 as one batch (what 16 clients' requests become in a batching server, here
with no queueing, no network and no tokenisation elsewhere). Prints one line per second of progress
and then one JSON line: requests_per_second (sentences encoded per second), p50_ms and p99_ms (per
encode() call), errors (0), calls.
"""
import argparse
import json
import time

import numpy as np
import torch
from sentence_transformers import SentenceTransformer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--sentences", required=True)
    parser.add_argument("--duration_s", type=float, default=8)
    parser.add_argument("--warmup", type=float, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    sentences = [line.rstrip("\n") for line in open(opts.sentences, encoding="utf-8") if line.strip()]
    model = SentenceTransformer(opts.model, device="cpu")
    model.eval()

    def call():
        with torch.inference_mode():
            vectors = model.encode(sentences, batch_size=len(sentences), convert_to_numpy=True,
                                   show_progress_bar=False)
        if vectors.shape[0] != len(sentences):
            raise RuntimeError("encode returned %d vectors for %d sentences" % (vectors.shape[0], len(sentences)))

    end = time.perf_counter() + opts.warmup
    while time.perf_counter() < end:
        call()
    latencies = []
    start = time.perf_counter()
    end = start + opts.duration_s
    next_report = start + 1
    while time.perf_counter() < end:
        t = time.perf_counter()
        call()
        latencies.append(time.perf_counter() - t)
        if time.perf_counter() >= next_report:
            print("st-encode: %d calls" % len(latencies), flush=True)
            next_report += 1
    elapsed = time.perf_counter() - start
    ms = np.asarray(latencies) * 1000
    print(json.dumps({"requests_per_second": len(latencies) * len(sentences) / elapsed,
                      "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
                      "errors": 0, "calls": len(latencies)}))


if __name__ == "__main__":
    main()
