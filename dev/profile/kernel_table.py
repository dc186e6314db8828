"""Sums an `ncu --csv --metrics gpu__time_duration.sum` log per kernel name: launches, total us, share, mean us.
    python3 dev/profile/kernel_table.py ncu.csv [--top 25]"""
import argparse
import csv
import io
import re
from collections import defaultdict

ap = argparse.ArgumentParser()
ap.add_argument("csv")
ap.add_argument("--top", type=int, default=25)
args = ap.parse_args()
text = open(args.csv, errors="replace").read()
start = text.find('"ID"')
if start < 0:
    raise SystemExit(f"{args.csv}: no ncu CSV table found")
tot, cnt = defaultdict(float), defaultdict(int)
for row in csv.DictReader(io.StringIO(text[start:])):
    if row.get("Metric Name") != "gpu__time_duration.sum":
        continue
    name = re.sub(r"\(.*", "", row["Kernel Name"]).strip()[:70]
    scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}.get(row.get("Metric Unit", "nsecond"), 1e-3)
    tot[name] += float(row["Metric Value"].replace(",", "")) * scale
    cnt[name] += 1
all_us = sum(tot.values())
print(f"{sum(cnt.values())} kernels, {all_us:.0f} us of kernel time (serialized by ncu)")
for name, us in sorted(tot.items(), key=lambda kv: -kv[1])[: args.top]:
    print(f"  {us:9.1f} us {100 * us / all_us:5.1f}%  {cnt[name]:5d} x {us / cnt[name]:7.2f} us  {name}")
