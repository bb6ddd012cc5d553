# Per-kernel launches, total and mean time from `ncu --csv --metrics gpu__time_duration.sum`,
# sorted by total; with a second argument (a regex), only kernels whose name matches it.
import collections, csv, re, sys
with open(sys.argv[1]) as f:
    lines = [l for l in f if l.startswith('"')]
pat = re.compile(sys.argv[2]) if len(sys.argv) > 2 else None
tot = collections.Counter(); cnt = collections.Counter(); mn = {}
for row in csv.DictReader(lines):
    if row.get("Metric Name") != "gpu__time_duration.sum":
        continue
    name = row["Kernel Name"].split("(")[0]
    if pat and not pat.search(name):
        continue
    unit = row.get("Metric Unit", "ns")
    us = float(row["Metric Value"].replace(",", "")) * {"ns": 1e-3, "nsecond": 1e-3, "us": 1, "usecond": 1, "ms": 1e3, "msecond": 1e3}.get(unit, 1e-3)
    tot[name] += us; cnt[name] += 1; mn[name] = min(mn.get(name, us), us)
print("%10s %7s %9s %9s  %s" % ("total_us", "count", "mean_us", "min_us", "kernel"))
for n, v in tot.most_common(60):
    print("%10.1f %7d %9.2f %9.2f  %s" % (v, cnt[n], v / cnt[n], mn[n], n[:120]))
