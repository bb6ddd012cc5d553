"""Summarises one interference run: the client's figures and the server's step log over the
long prefill (the slowest steps, the longest gaps between steps, trims, and the steps around
the client's largest gaps)."""
import json, re, sys
from datetime import datetime, timezone

name, js, log = sys.argv[1:4]
r = json.load(open(js))
d = r['itl_during_prefill_ms']; s = r['steady_itl_ms']['p50']
print('%s: steady ITL p50 %.2f ms; during prefill p50 %.2f p90 %.2f p99 %.2f max %.2f ms; '
      'p50/steady %.2fx p90 %.2fx p99 %.2fx max %.2fx; long prefill %.0f ms (status %s)' % (
          name, s, d['p50'], d['p90'], d['p99'], d['max'], d['p50'] / s, d['p90'] / s, d['p99'] / s,
          r['max_during_over_steady_p50'], r['long_prefill_ms'], r['long_status']))
t0 = r['long_sent_unix']; t1 = t0 + r['long_prefill_ms'] / 1e3
ansi = re.compile(r'\x1b\[[0-9;]*m')
steps, trims = [], []
pat = re.compile(r'step (\d+): engine ([\d.]+) ms, events ([\d.]+) ms, before it ([\d.]+) ms; (.*)')
for line in open(log, errors='replace'):
    line = ansi.sub('', line).rstrip()
    try:
        ts = datetime.strptime(line[:26], '%Y-%m-%dT%H:%M:%S.%f').replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        continue
    m = pat.search(line)
    if m:
        steps.append((ts - t0, float(m[2]), float(m[3]), float(m[4]), m[5]))
    elif 'malloc_trim took' in line:
        trims.append((ts - t0, line.split('malloc_trim took')[1].strip()))
win = [x for x in steps if -0.02 <= x[0] <= t1 - t0 + 0.05]
if not win:
    print('  no step log lines in the window (%d in all)' % len(steps)); sys.exit()
pc = lambda xs, q: sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]
eng = [x[1] for x in win]
print('  server: %d steps in the window; engine ms p50 %.2f p90 %.2f p99 %.2f max %.2f; '
      'events max %.2f; between steps max %.2f ms' % (len(win), pc(eng, .5), pc(eng, .9), pc(eng, .99),
                                                        max(eng), max(x[2] for x in win), max(x[3] for x in win)))
tot = [x[1] + x[2] + x[3] for x in win]
print('  engine + events + between: p50 %.2f p99 %.2f max %.2f ms' % (pc(tot, .5), pc(tot, .99), max(tot)))
fmt = lambda x: '    @%+.3f s engine %.2f events %.2f before %.2f | %s' % (x[0], x[1], x[2], x[3], x[4][:170])
print('  slowest steps:'); [print(fmt(x)) for x in sorted(win, key=lambda x: -x[1])[:6]]
print('  longest gaps before a step:'); [print(fmt(x)) for x in sorted(win, key=lambda x: -x[3])[:3]]
print('  trims in the window:', [t for t in trims if -1 <= t[0] <= t1 - t0 + 1][:6])
for g, at, i in r['largest_gaps_ms_at_ms_stream'][:3]:
    lo, hi = at / 1e3 - 0.002, (at + g) / 1e3 + 0.002
    near = [x for x in steps if lo <= x[0] <= hi]
    print('  client gap %.2f ms at +%.3f s (stream %d): %d steps ended in it' % (g, at / 1e3, i, len(near)))
    for x in near[:4]:
        print('  ' + fmt(x))
pieces = [(x[0], x[4].split('prefill [')[1].split(']')[0]) for x in win if 'prefill [' in x[4]]
if pieces:
    k = max(1, len(pieces) // 10)
    print('  pieces (at s: tokens@position):', ' '.join('%.1f:%s' % p for p in pieces[::k])[:600])
