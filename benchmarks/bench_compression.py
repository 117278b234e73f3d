"""Compression of checkpoint tensors (``compression="zstd"``) against the raw disk, and whether
``compression="auto"`` picks the faster option on this disk and on a slower link.

For fp32, bf16 and int8 state (weights as training leaves them: small normal values; int8 as
quantized weights), in one run:

- ``disk``: a raw write + fsync of the same bytes (the disk's limit, the baseline);
- ``raw``: our uncompressed tensor file (safetensors + xxh3, write + fsync);
- ``zstd`` at level L, with and without the byte-shuffle: compress + write + fsync, and the ratio.

The slower link (default 10 MB/s, ``--link-mbps``) is simulated: moving B bytes costs B / rate
seconds, added to the measured local write; compressing saves ``(1 - ratio) * B / rate``.
``auto`` is then asked (:class:`resilient_callbacks.compression.Chooser`, fed with the measured
raw disk throughput and, for the link, the link rate) and its choice compared with the option
that was measured faster.

    python benchmarks/bench_compression.py --mb 256 --reps 3
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time

import torch
from common import fsync_path, library_version, med, write_results

from resilient_callbacks.compression import Chooser, write_tensors_compressed
from resilient_callbacks.tensorfile import write_tensors


def make(kind: str, nbytes: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if kind == "int8":
        n = nbytes
        w = (torch.randn(n, generator=g) * 20).round().clamp(-127, 127).to(torch.int8)
    else:
        dtype = torch.float32 if kind == "fp32" else torch.bfloat16
        n = nbytes // (4 if kind == "fp32" else 2)
        w = (torch.randn(n, generator=g) * 0.02).to(dtype)
    # several tensors, as a state dict has
    return {f"layer{i}.weight": c.clone() for i, c in enumerate(w.chunk(8))}


def timed(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return med(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=int, default=256, help="MB of state per dtype")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--level", type=int, default=1)
    ap.add_argument("--link-mbps", type=float, default=10.0, help="simulated link, MB/s")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    )
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="bench-zstd-", dir=args.dir)
    nbytes = args.mb << 20
    link = args.link_mbps * 1e6
    rows = []
    try:
        for kind in ("fp32", "bf16", "int8"):
            tensors = make(kind, nbytes)
            raw_bytes = b"".join(
                bytes(t.reshape(-1).view(torch.uint8).numpy()) for t in tensors.values()
            )
            path = os.path.join(root, "f")

            def disk(data: bytes = raw_bytes, path: str = path) -> None:
                with open(path, "wb", buffering=0) as f:
                    f.write(data)
                    os.fsync(f.fileno())

            t_disk = timed(disk, args.reps)
            t_raw = timed(lambda p=path, t=tensors: write_tensors(p, t), args.reps)
            res = {"kind": kind, "mb": args.mb, "disk_s": t_disk, "raw_s": t_raw}
            for shuffle in (False, True):
                sizes = []

                def z(
                    shuffle: bool = shuffle, sizes: list = sizes, p: str = path, t: dict = tensors
                ) -> None:
                    d, _ = write_tensors_compressed(
                        p + ".zst", t, level=args.level, with_shuffle=shuffle
                    )
                    sizes.append(d.size)

                t = timed(z, args.reps)
                tag = "zstd_shuffle" if shuffle else "zstd"
                res[f"{tag}_s"] = t
                res[f"{tag}_ratio"] = sizes[-1] / nbytes
            fsync_path(root)
            # auto: measured raw disk, then the sample; the simulated link adds B / rate
            best_z = "zstd_shuffle" if res["zstd_shuffle_s"] <= res["zstd_s"] else "zstd"
            shuffle_best = best_z == "zstd_shuffle"
            for where, sinks_rate in (("disk", None), ("link", link)):
                t_plain = t_raw + (nbytes / sinks_rate if sinks_rate else 0.0)
                t_comp = res[f"{best_z}_s"] + (
                    res[f"{best_z}_ratio"] * nbytes / sinks_rate if sinks_rate else 0.0
                )
                c = Chooser(
                    "auto",
                    args.level,
                    shuffle_best,
                    (lambda r=sinks_rate: r) if sinks_rate else None,
                )
                c.observe_raw_write(nbytes, t_raw)
                chose = c.compress_now(tensors)
                faster = t_comp < t_plain
                res[f"auto_{where}"] = {
                    "raw_s": t_plain,
                    "zstd_s": t_comp,
                    "chose_zstd": chose,
                    "zstd_faster": faster,
                    "right": chose == faster,
                    "sample_ratio": c.sample.ratio if c.sample else None,
                    "sample_compress_mbps": c.sample.compress_bps / 1e6 if c.sample else None,
                }
            rows.append(res)
            print(res)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    md = [
        f"Machine: {platform.node()}, {os.cpu_count()} CPUs; library {library_version()}; "
        f"level {args.level}; {args.mb} MB per dtype; medians of {args.reps}; simulated link "
        f"{args.link_mbps:g} MB/s.",
        "",
        "| state | disk write+fsync MB/s | raw file MB/s | zstd MB/s (ratio) | "
        "zstd+shuffle MB/s (ratio) | zstd+shuffle time / disk |",
        "|---|---|---|---|---|---|",
    ]
    mb = args.mb * 1.048576
    for r in rows:
        md.append(
            f"| {r['kind']} | {mb / r['disk_s']:.0f} | {mb / r['raw_s']:.0f} | "
            f"{mb / r['zstd_s']:.0f} ({r['zstd_ratio']:.3f}) | "
            f"{mb / r['zstd_shuffle_s']:.0f} ({r['zstd_shuffle_ratio']:.3f}) | "
            f"{r['zstd_shuffle_s'] / r['disk_s']:.2f}x |"
        )
    md += [
        "",
        "| state | where | raw s | zstd s | auto chose | right? |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        for where in ("disk", "link"):
            a = r[f"auto_{where}"]
            md.append(
                f"| {r['kind']} | {where} | {a['raw_s']:.3f} | {a['zstd_s']:.3f} | "
                f"{'zstd' if a['chose_zstd'] else 'raw'} | {'yes' if a['right'] else 'NO'} |"
            )
    text = "\n".join(md) + "\n"
    print(text)
    write_results(args.out, "bench_compression", rows, text)


if __name__ == "__main__":
    main()
