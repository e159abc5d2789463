#!/usr/bin/env python3
"""Where one decode step's time goes on the GPU, kernel by kernel, from
Nsight Compute's raw CSV (ncu --csv --page raw --metrics
gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum).

    python3 scripts/cuda/profile.py NCU.csv [STEP_KERNELS]

Groups the launches by kernel name (templates shortened) and prints, per
group, the launches, the total time, the DRAM bytes and the rate they ran
at, then the step's total: the time the GPU spent in kernels, with no launch
gaps (a graph's replay adds those)."""
import csv
import re
import sys


def short(name):
    name = re.sub(r"\(.*$", "", name)  # drop the argument list
    name = re.sub(r"^void ", "", name)
    return name[:70]


def main():
    lines = open(sys.argv[1], newline="").read().splitlines()
    lines = lines[next((i for i, l in enumerate(lines) if l.startswith('"ID"')), len(lines)):]
    rows = list(csv.DictReader(lines))
    rows_units = {}
    if rows and not rows[0].get("Kernel Name"):
        rows_units = {k: v for k, v in rows[0].items() if v}
    rows = [r for r in rows if r.get("Kernel Name") and r.get("gpu__time_duration.sum", "").replace(",", "").replace(".", "").isdigit()]
    if not rows:
        print("no kernels in", sys.argv[1])
        return 1

    # whole steps only: from the first embedding launch to the last
    at = [i for i, r in enumerate(rows) if "embed" in r["Kernel Name"]]
    if len(at) >= 2:
        rows = rows[at[0]:at[-1]]

    def num(r, k):
        return float(r[k].replace(",", ""))

    def ns(r):
        v = num(r, "gpu__time_duration.sum")
        unit = rows_units.get("gpu__time_duration.sum", "nsecond")
        return v * {"nsecond": 1, "usecond": 1e3, "msecond": 1e6}.get(unit, 1)

    def byts(r, k):
        v = num(r, k)
        unit = rows_units.get(k, "byte")
        return v * {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}.get(unit, 1)

    groups = {}
    order = []
    for r in rows:
        k = short(r["Kernel Name"])
        if k not in groups:
            groups[k] = [0, 0.0, 0.0]
            order.append(k)
        g = groups[k]
        g[0] += 1
        g[1] += ns(r)
        g[2] += byts(r, "dram__bytes_read.sum") + byts(r, "dram__bytes_write.sum")
    # per decode step: every pass starts with one embedding launch
    steps = sum(g[0] for k, g in groups.items() if "embed" in k) or 1
    for g in groups.values():
        g[0] /= steps
        g[1] /= steps
        g[2] /= steps
    print(f"{steps} decode steps profiled; per step:")
    tot_t = sum(g[1] for g in groups.values())
    tot_b = sum(g[2] for g in groups.values())
    print(f"{'kernel':70s} {'n':>5s} {'us':>9s} {'share':>6s} {'MB':>8s} {'GB/s':>7s}")
    for k in sorted(order, key=lambda k: -groups[k][1]):
        n, t, b = groups[k]
        print(f"{k:70s} {n:5.0f} {t / 1e3:9.1f} {100 * t / tot_t:5.1f}% {b / 1e6:8.1f} {b / t if t else 0:7.0f}")
    print(f"{'all':70s} {len(rows) / steps:5.0f} {tot_t / 1e3:9.1f} {100.0:5.1f}% {tot_b / 1e6:8.1f} {tot_b / tot_t:7.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
