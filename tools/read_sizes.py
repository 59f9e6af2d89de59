"""How fast a plain streaming read of N bytes can be, timed as the MoE calls are (GPU only).

    PYTHONPATH=python python3 -m tools.read_sizes [--mb 25,50,75,150,300,704] [--json FILE]

For each size: opgraft's streaming-read kernel (the read-ceiling kernel, 16-byte loads) over one
of several buffers (rotated, > 512 MB in all, so L2 holds none of it), 64 MiB of other reads
before each call, per-call µs from the kernels' own end times (bench.time_calls_span). The
result is the time a call that only had to read those bytes would take, launch and ramp
included: the floor for a small MoE call of the same bytes.
"""
import argparse
import sys

from opgraft import _lib
from opgraft._entry import check_outputs, require_gpu


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.read_sizes")
    ap.add_argument("--mb", default="12.5,25,50,75,150,300,704")
    ap.add_argument("--grids", default="0,1,2", help="blocks per SM (0 = the kernel's default, 4)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not check_outputs("tools.read_sizes", {"--json": args.json}):
        return 2
    torch = require_gpu("tools.read_sizes")
    from opgraft import bench

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ceiling = bench.measure_read_ceiling("cuda")
    between = bench.between_traffic(bench.BETWEEN_MIB, "cuda")
    sink = torch.zeros(4, dtype=torch.int32, device="cuda")
    rows = []
    for mb in [float(m) for m in args.mb.split(",")]:
        n = int(mb * 1e6) // 16 * 16
        copies = max(2, min(16, int(512e6 // n) + 1))
        bufs = [torch.ones(n // 4, dtype=torch.int32, device="cuda") for _ in range(copies)]
        for per_sm in [int(g) for g in args.grids.split(",")]:
            grid = per_sm * sms

            def call(i, _):
                _lib.check(_lib.lib().opgraft_stream_read(
                    bufs[i].data_ptr(), n, sink.data_ptr(), grid, torch.cuda.current_stream().cuda_stream))

            us = bench.time_calls_span(call, [(i, None) for i in range(copies)], between)
            rows.append({"mb": mb, "bytes": n, "blocks_per_sm": per_sm or 4, "us": us,
                         "tbps": n / (us * 1e-6) / 1e12, "fraction_of_ceiling": n / (us * 1e-6) / 1e12 / ceiling})
            r = rows[-1]
            print(f"{mb:7.1f} MB  {r['blocks_per_sm']} blocks/SM  {us:8.2f} us  {r['tbps']:.2f} TB/s  "
                  f"{r['fraction_of_ceiling']:.3f} of {ceiling:.2f}", flush=True)
        bufs = None  # free this size before allocating the next
    if args.json:
        bench.write_rows(args.json, ceiling, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
