"""``Router.load`` with and without ``sdk.kinds.load_bundle``'s worker thread, in one process, as a ratio.

The worker reads and hashes the used files of >= ``sdk.kinds.BACKGROUND_BYTES`` (a static table) while the
kinds build the tokenizer. Here the same bundle is loaded ``--pairs`` times each way, the two taking turns
(the worker off: ``BACKGROUND_BYTES`` above every file), modules imported and files in the page cache, so only
the overlap differs. The fresh-process view is ``benchmarks/cold_start_breakdown.py``.

    python benchmarks/load_bundle_worker.py --bundle results/latency-bundles/bundles/static \\
        --public-key results/latency-bundles/keys/signing.pub [--pairs 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from sdk import Router, kinds


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", required=True, help="a static-embedder router bundle")
    parser.add_argument("--public-key", required=True)
    parser.add_argument("--precision", default="int8")
    parser.add_argument("--pairs", type=int, default=200, help="loads each way, taking turns")
    args = parser.parse_args(argv)
    on = kinds.BACKGROUND_BYTES
    times: dict[str, list[float]] = {"worker": [], "no worker": []}
    for i in range(2 * args.pairs + 2):  # the first pair warms up and is dropped
        mode = "worker" if i % 2 == 0 else "no worker"
        kinds.BACKGROUND_BYTES = on if mode == "worker" else 1 << 62
        t0 = time.perf_counter()
        Router.load(args.bundle, args.public_key, precision=args.precision)
        if i >= 2:
            times[mode].append((time.perf_counter() - t0) * 1e3)
    out = {f"{stat} {mode} ms": f(t) for mode, t in times.items() for stat, f in (("median", statistics.median),
                                                                                   ("min", min))}
    out["median ratio worker / no worker"] = out["median worker ms"] / out["median no worker ms"]
    out["min ratio worker / no worker"] = out["min worker ms"] / out["min no worker ms"]
    print(f"{args.pairs} pairs, load average {os.getloadavg()[0]:.2f}")
    for key, value in out.items():
        print(f"{key}: {value:.3f}")
    return out


if __name__ == "__main__":
    main()
