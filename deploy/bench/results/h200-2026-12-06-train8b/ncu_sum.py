# Sums ncu --csv gpu__time_duration.sum per kernel name; splits the profile into its steps by the
# order of launches is not possible here, so it reports totals over the whole run and the share of
# each kernel family.
import csv, sys, collections, re
rows = []
with open(sys.argv[1]) as f:
    lines = [l for l in f if l.startswith('"')]
r = csv.DictReader(lines)
tot = collections.Counter(); cnt = collections.Counter()
for row in r:
    if row.get("Metric Name") != "gpu__time_duration.sum": continue
    name = row["Kernel Name"]; v = float(row["Metric Value"].replace(",", ""))
    unit = row.get("Metric Unit", "ns")
    scale = {"ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3, "ms": 1e-3, "nsecond": 1e-9}.get(unit, 1e-9)
    tot[name] += v * scale; cnt[name] += 1
def fam(n):
    n = n.lower()
    for k in ["gemm", "gemv", "attn", "linear_ce", "adamw", "rms", "rope", "silu", "softmax", "copy", "cast", "fill", "affine", "binary", "unary", "reduce", "where", "index", "cat", "rand", "topk"]:
        if k in n: return k
    return "other"
ft = collections.Counter()
for n, v in tot.items(): ft[fam(n)] += v
all_s = sum(tot.values())
print("total GPU kernel time %.3f s over %d launches" % (all_s, sum(cnt.values())))
print("by family:")
for k, v in ft.most_common(): print("  %-10s %8.3f s %5.1f%%" % (k, v, 100 * v / all_s))
print("top kernels:")
for n, v in tot.most_common(30): print("  %8.4f s %6d x  %s" % (v, cnt[n], n[:150]))
